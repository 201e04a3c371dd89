"""
The transformers side of scripts/finetune_demo.py on the CPU (the fine-tune itself needs a GPU: run the script there).
A tiny random-init model made as the demo makes its own goes through the converter's import and export (what
`make finetune` does with train_llama3cu -e DIR ... -X DIR and the tokenizer step, minus the training), then:
  - the demo's val loss equals transformers' own masked loss (labels with -100), and is the same before and after
    the round trip (HF -> ours -> HF keeps the bf16 bits);
  - the exported chat template encodes the val conversations to chat_to_shards.py's tokens (answer_questions
    checks it), and every assistant turn gets an answer;
  - the exported tokenizer decodes text back unchanged and without warnings (no clean-up of spaces);
  - the log and sample parsing the summary relies on.
Needs torch, transformers and tiktoken (the repo's tokenizer.model, or $LLAMA3_TOKENIZER); skipped otherwise (CI).
"""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

TOKENIZER = os.environ.get("LLAMA3_TOKENIZER") or os.path.join(ROOT, "dev", "data", "llama3", "tokenizer.model")
MODULES = ("torch", "transformers", "tiktoken")
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in MODULES) or not os.path.isfile(TOKENIZER),
    reason="needs torch, transformers and tiktoken")

B, T = 2, 512


def run_ok(cmd):
    result = subprocess.run([sys.executable] + [str(c) for c in cmd], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """(base HF dir, exported HF dir with tokenizer files, val shard)."""
    import finetune_demo

    root = tmp_path_factory.mktemp("demo")
    config = dict(finetune_demo.MODEL_CONFIG, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    finetune_demo.make_base_model(root / "base", config)
    run_ok(["scripts/convert_hf.py", "import", root / "base", root / "model.bin"])
    run_ok(["scripts/convert_hf.py", "export", root / "model.bin", root / "hf", "--tokenizer", TOKENIZER])
    run_ok(["dev/data/chat_to_shards.py", "--tokenizer", TOKENIZER, "--val", finetune_demo.CHAT_VAL, "--out_dir",
            root / "data", "--seq_len", T])
    return root / "base", root / "hf", str(root / "data" / "chat_val_000000.bin")


def test_val_loss_is_transformers_masked_loss(round_trip):
    import numpy as np
    import torch
    from finetune_demo import load, val_loss
    from shards import read_loss_mask, read_shard

    base, export, shard = round_trip
    model = load(base, "cpu")
    ours = val_loss(model, shard, B, T, "cpu")
    # transformers' loss: labels are the inputs with the uncounted targets at -100, shifted inside the model; one
    # token more than the row, so that its shift covers the row's T targets (causal: the logits do not change)
    tokens, mask = read_shard(shard).astype(np.int64), read_loss_mask(shard)
    n = (len(tokens) - 1) // (B * T) * B * T
    total, counted = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, T):
            row = torch.tensor(tokens[start:start + T + 1])
            labels = torch.where(torch.tensor(mask[start:start + T + 1]) == 1, row, -100)
            count = int((labels[1:] != -100).sum())
            if count:
                total += float(model(input_ids=row[None], labels=labels[None]).loss) * count
            counted += count
    assert counted > 1000 and ours == pytest.approx(total / counted, rel=1e-5)
    assert val_loss(load(export, "cpu"), shard, B, T, "cpu") == ours  # the round trip keeps the bits


def test_export_answers_in_transformers(round_trip):
    from finetune_demo import answer_questions, read_conversations

    _, export, _ = round_trip
    conversations = read_conversations()[:4]
    results = answer_questions(export, TOKENIZER, conversations, "cpu", max_new_tokens=4)
    turns = [(m[:i], m[i]["content"]) for m in conversations for i in range(len(m)) if m[i]["role"] == "assistant"]
    assert [(context, expected) for context, expected, _ in results] == turns
    assert all(isinstance(answer, str) for _, _, answer in results)


def test_exported_tokenizer_decodes_text_unchanged(round_trip):
    from transformers import AutoTokenizer
    from transformers_quiet import loads_without_warnings

    _, export, _ = round_trip
    text = "'silver' starts with the letter 's'. It isn't 'SILVER' , is it ?"
    with loads_without_warnings():
        tokenizer = AutoTokenizer.from_pretrained(export)
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_summary_parsing(tmp_path):
    from finetune_demo import FINETUNE, last_sample, trainer_val_losses, write_summary

    log = tmp_path / "log.txt"
    log.write_text("step 0 val_loss 11.9\nstep 1 train_loss 11.8 norm 1.0\nstep 50 val_loss 1.25\n"
                   "step 100 val_loss 0.5\n")
    assert trainer_val_losses(log) == {0: 11.9, 50: 1.25, 100: 0.5}
    output = ("step 100 | val loss 0.5 (2 batches)\nsample: <|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>\nsaved checkpoint x\n")
    assert last_sample(output) == ("sample: <|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|>"
                                   "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>")
    assert last_sample("no samples here") == ""
    results = [([{"role": "user", "content": "Hi?"}], "Hello.", "Hello."),
               ([{"role": "user", "content": "Bye?"}], "Bye.", "Hello.")]
    text = write_summary(tmp_path / "summary.txt", FINETUNE, {"make": 60.0, "total": 90.0}, 11.9, 0.5, 11.8, 0.51,
                         "sample: x", results)
    assert (tmp_path / "summary.txt").read_text() == text
    assert "val loss before: 11.9000 (trainer, step 0), 11.8000" in text and "2 assistant turns" in text
    assert "1 exact (50%)" in text and "A: Hello.   [exact]" in text and "A: Hello.   [expected: Bye.]" in text
