"""
Import, fine-tune and export end to end on one GPU in a few minutes: a model made by transformers goes through
`make finetune` on the shipped chat set and comes back answering questions in transformers.

  1. transformers makes a small Llama 3-shaped model from a random init (MODEL_CONFIG: the Llama 3 vocab, so the
     real tokenizer works, grouped-query attention, tied embeddings, Llama 3.2's RoPE scaling block) and saves it
     with save_pretrained in bf16, as Meta's weights are released: the stand-in for a downloaded model;
  2. `make finetune MODEL=<that directory>` trains it on dev/data/chat from the HF directory directly, with settings
     for a model that knows nothing yet (FINETUNE: a high lr, many epochs of the 900 conversations); it prints the
     val loss before and after and a sample answer, plots loss.png and exports the result with its tokenizer files;
  3. transformers loads the export (AutoModelForCausalLM, AutoTokenizer), checks that its chat template gives the
     very tokens the trainer was trained on, answers every assistant turn of the val conversations greedily and
     counts the answers that match the expected ones exactly; it also computes the val loss of the starting model
     and of the export itself, to set beside the trainer's;
  4. OUT/summary.txt holds those numbers and some answers; OUT/loss.png the loss curve.

    python3 scripts/finetune_demo.py --out runs/demo

Needs a GPU, nvcc (make builds train_llama3cu when it is not up to date), torch and transformers 5. OUT must be new
or empty; it gets base/ (the starting model), data/ (chat shards), run/ (log.txt, the final checkpoint, hf/ the
export), finetune.log (make's output), loss.png and summary.txt.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "dev", "data"))
from chat_to_shards import ChatEncoder  # noqa: E402
from llama3_tokenizer import Llama3Tokenizer, resolve_tokenizer_path  # noqa: E402
from shards import read_loss_mask, read_shard  # noqa: E402

CHAT_VAL = os.path.join(REPO, "dev", "data", "chat", "chat_val.jsonl")

# A Llama 3.2-shaped model, small: 256 wide, 4 layers, 4 query heads of 64 sharing 2 kv heads, FFN 4x, tied
# embeddings (33M parameters in the embedding, 3M in the layers).
MODEL_CONFIG = dict(vocab_size=128256, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
                    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=8192))
SEED = 1234

# `make finetune` settings. The 900 train conversations pack into 74 rows of 512 tokens (10,742 answer tokens), so
# with 4 rows a step an epoch is 18 steps. A model from a random init needs a pretraining-like lr and many epochs:
# the answers' shared phrasing comes within a few epochs, copying the question's words and numbers into the answer
# and the lookups (the day after Tuesday) take longer. A step of this model takes milliseconds, so the run is short
# anyway; a released model would take the Makefile's defaults (lr 2e-5, 40 steps). FT_PROMPT is a val question.
FINETUNE = dict(FT_T=512, FT_STEPS=2000, FT_FLAGS="-b 4 -l 2e-3 -u 50 -v 100 -m -1",
                FT_PROMPT="Which day follows Tuesday?")
B, T = 4, 512  # FT_FLAGS' -b and FT_T: the val loss below covers the same rows as the trainer's


def make_base_model(out_dir, config=MODEL_CONFIG, seed=SEED):
    """Step 1: a random-init LlamaForCausalLM saved in bf16 with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out_dir}: random-init LlamaForCausalLM, {n / 1e6:.1f}M parameters, bf16")


def run_finetune(model_dir, out, tokenizer_path, settings=FINETUNE):
    """Step 2: `make finetune` into out/; its output goes to the terminal and out/finetune.log. Returns the output."""
    cmd = ["make", "-C", REPO, "finetune", f"MODEL={model_dir}", f"FT_DATA_DIR={out}/data", f"FT_RUN_DIR={out}/run",
           f"EXPORT_DIR={out}/run/hf", f"LLAMA3_TOKENIZER={tokenizer_path}", f"PYTHON={sys.executable}"]
    cmd += [f"{k}={v}" for k, v in settings.items()]
    print(" ".join(f"'{c}'" if " " in c else c for c in cmd), flush=True)
    lines = []
    with open(os.path.join(out, "finetune.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            lines.append(line)
        if proc.wait() != 0:
            sys.exit(f"error: make finetune failed (exit {proc.returncode}); see {out}/finetune.log")
    return "".join(lines)


def trainer_val_losses(log_path):
    """{step: val loss} from the trainer's log.txt."""
    losses = {}
    with open(log_path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[0] == "step" and parts[2] == "val_loss":
                losses[int(parts[1])] = float(parts[3])
    return losses


def last_sample(output):
    """The trainer's last `sample:` (it spans lines: the prompt holds newlines), up to its next status line."""
    start = output.rfind("\nsample: ")
    if start < 0:
        return ""
    end = re.compile(r"^(saved checkpoint|summary:|step |exported)", re.M).search(output, start + 1)
    return output[start + 1:end.start() if end else len(output)].strip()


def load(model_dir, device):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


def val_loss(model, shard, B, T, device):
    """Mean cross-entropy over the val targets the loss mask counts, on the rows the trainer's val pass reads: the
    first (N - 1) // (B T) batches of B rows of T tokens."""
    import torch

    tokens, mask = read_shard(shard).astype(np.int64), read_loss_mask(shard)
    n = (len(tokens) - 1) // (B * T) * B * T
    inputs = torch.tensor(tokens[:n].reshape(-1, T), device=device)
    targets = torch.tensor(np.where(mask[1:n + 1] == 1, tokens[1:n + 1], -100).reshape(-1, T), device=device)
    total, counted = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(inputs), B):
            logits = model(input_ids=inputs[i:i + B]).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[i:i + B].flatten(),
                                                             ignore_index=-100, reduction="sum"))
            counted += int((targets[i:i + B] != -100).sum())
    return total / counted


def read_conversations(path=CHAT_VAL):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def answer_questions(model_dir, tokenizer_path, conversations, device, max_new_tokens=40):
    """Step 3: every assistant turn of the conversations, answered greedily by the HF model given the turns before
    it. Returns [(messages before it, expected, answer)]. Checks first that transformers' chat template encodes each
    whole conversation to the tokens chat_to_shards.py trains on."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoder = ChatEncoder(Llama3Tokenizer(tokenizer_path))
    model = load(model_dir, device)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    results = []
    for messages in conversations:
        templated = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        if list(templated) != encoder.encode(messages)[0]:
            sys.exit(f"error: the exported chat template encodes {messages} differently from chat_to_shards.py")
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"].to(device)
            with torch.no_grad():
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                     do_sample=False, eos_token_id=eot, pad_token_id=eot)
            answer = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True).strip()
            results.append((messages[:i], message["content"], answer))
    return results


def write_summary(path, settings, seconds, before, after, hf_before, hf_after, sample, results, shown=12):
    exact = sum(expected == answer for _, expected, answer in results)
    lines = [
        "Fine-tune of a random-init transformers Llama (scripts/finetune_demo.py) on dev/data/chat",
        f"model: {json.dumps(MODEL_CONFIG)}",
        f"make finetune: {json.dumps(settings)}",
        f"wall time: {seconds['make']:.0f} s in make finetune (the build included), {seconds['total']:.0f} s in all",
        "",
        f"val loss before: {before:.4f} (trainer, step 0), {hf_before:.4f} (transformers, the starting model)",
        f"val loss after:  {after:.4f} (trainer, last step), {hf_after:.4f} (transformers, the export)",
        "",
        "the trainer's last sample (temperature 1):",
        sample,
        "",
        f"the export in transformers, greedy, on the {len(results)} assistant turns of the val conversations: "
        f"{exact} exact ({100 * exact / len(results):.0f}%)",
    ]
    for context, expected, answer in results[:shown]:
        lines.append(f"  Q: {context[-1]['content']}")
        lines.append(f"  A: {answer}   [{'exact' if answer == expected else 'expected: ' + expected}]")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def main():
    start = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="output directory (default: $OUT)")
    parser.add_argument("--tokenizer", default=None, help="Llama 3 tokenizer.model (default: $LLAMA3_TOKENIZER, else the repo's copy)")
    parser.add_argument("--steps", type=int, default=FINETUNE["FT_STEPS"], help="training steps (default %(default)s)")
    args = parser.parse_args()
    if args.steps < 1:
        sys.exit(f"error: --steps {args.steps} must be >= 1")
    if not args.out:
        sys.exit("error: give --out DIR (or set OUT)")
    out = os.path.abspath(args.out)
    if os.path.isdir(out) and os.listdir(out):
        sys.exit(f"error: --out {out} is not empty: choose a new directory or remove it")
    try:
        tokenizer_path = os.path.abspath(resolve_tokenizer_path(args.tokenizer))
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: no GPU: the fine-tune runs on the CUDA trainer")
    os.makedirs(out, exist_ok=True)

    base = os.path.join(out, "base")
    make_base_model(base)
    settings = dict(FINETUNE, FT_STEPS=args.steps)
    make_start = time.monotonic()
    output = run_finetune(base, out, tokenizer_path, settings)
    seconds = {"make": time.monotonic() - make_start}
    shutil.copy(os.path.join(out, "run", "loss.png"), os.path.join(out, "loss.png"))

    losses = trainer_val_losses(os.path.join(out, "run", "log.txt"))
    shard = os.path.join(out, "data", "chat_val_000000.bin")
    hf_before = val_loss(load(base, "cuda"), shard, B, T, "cuda")
    export = os.path.join(out, "run", "hf")
    hf_after = val_loss(load(export, "cuda"), shard, B, T, "cuda")
    results = answer_questions(export, tokenizer_path, read_conversations(), "cuda")
    seconds["total"] = time.monotonic() - start
    summary = write_summary(os.path.join(out, "summary.txt"), settings, seconds, losses[0], losses[max(losses)],
                            hf_before, hf_after, last_sample(output), results)
    print("\n" + summary + f"\nwrote {out}/summary.txt and {out}/loss.png")


if __name__ == "__main__":
    main()
