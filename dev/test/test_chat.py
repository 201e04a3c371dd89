"""
Tests of the chat data for fine-tuning: dev/data/chat_to_shards.py (the Llama 3 Instruct template, the loss mask,
packing, bad input), the shipped chat set (dev/data/make_chat_set.py), and the masked shards through the C++ loader
(dev/test/test_dataloader, built by `make`).

The tests that tokenize use the real Llama 3 tokenizer: the repo's copy, or the file LLAMA3_TOKENIZER names.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DATA_SCRIPTS = REPO / "dev" / "data"
CHAT_SET = DATA_SCRIPTS / "chat"
sys.path.insert(0, str(DATA_SCRIPTS))

import shards  # noqa: E402

CONVERSATION = {"messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2 plus 2?\n"},
    {"role": "assistant", "content": "2 plus 2 is 4."},
    {"role": "user", "content": "And <|eot_id|> times 3?"},
    {"role": "assistant", "content": "\nThat is 12. "},
]}
RENDERED = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 plus 2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n2 plus 2 is 4.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nAnd <|eot_id|> times 3?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nThat is 12.<|eot_id|>")


def tokenizer_path():
    path = os.environ.get("LLAMA3_TOKENIZER") or str(DATA_SCRIPTS / "llama3" / "tokenizer.model")
    if not os.path.isfile(path):
        pytest.fail(f"LLAMA3_TOKENIZER={path} does not exist")
    return path


@pytest.fixture(scope="module")
def encoder():
    import chat_to_shards
    from llama3_tokenizer import Llama3Tokenizer

    return chat_to_shards.ChatEncoder(Llama3Tokenizer(tokenizer_path()))


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def chat_to_shards(*args):
    env = dict(os.environ, LLAMA3_TOKENIZER=tokenizer_path())
    return subprocess.run([sys.executable, str(DATA_SCRIPTS / "chat_to_shards.py"), *map(str, args)],
                          capture_output=True, text=True, env=env)


# ---------------------------------------------------------------------------------------------------------------
# The template and the mask


def test_template_exact(encoder):
    tok = encoder.tok
    tokens, mask = encoder.encode(CONVERSATION["messages"])
    assert len(tokens) == len(mask)
    # the rendered text, byte for byte (contents stripped); user text that looks like a special token stays text
    assert tok.decode(tokens) == RENDERED
    assert tokens.count(tok.eot_id) == 5
    # the same ids as tokenizing the rendered text whole with its special tokens recognised, as Hugging Face's
    # chat template does (Meta's ChatFormat encodes the pieces; both agree), the literal "<|eot_id|>" aside
    literal = tok.encode("And <|eot_id|> times")
    placeholder = "And @@ times"
    whole = tok.model.encode(RENDERED.replace("And <|eot_id|> times", placeholder), allowed_special="all")
    cut = tok.encode(placeholder)
    at = next(i for i in range(len(whole)) if whole[i:i + len(cut)] == cut)
    assert tokens == whole[:at] + literal + whole[at + len(cut):]


def test_mask_counts_assistant_content_and_eot(encoder):
    tok = encoder.tok
    tokens, mask = encoder.encode(CONVERSATION["messages"])
    tokens, mask = np.array(tokens), np.array(mask)
    # the masked-in tokens form exactly two spans: each assistant answer and its <|eot_id|>
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    spans = list(zip(edges[0::2], edges[1::2]))
    assert [tok.decode(tokens[a:b].tolist()) for a, b in spans] == ["2 plus 2 is 4.<|eot_id|>", "That is 12.<|eot_id|>"]
    # each span starts right after an assistant header and ends with the turn's <|eot_id|>
    header = encoder.headers["assistant"]
    for a, b in spans:
        assert tokens[a - len(header):a].tolist() == header and tokens[b - 1] == tok.eot_id
    assert mask[0] == 0 and tokens[0] == tok.bos_id


def test_prompt_ends_with_the_assistant_header(encoder):
    tok = encoder.tok
    prompt = encoder.prompt(" What is 3 plus 4? ", "Be brief.")
    assert tok.decode(prompt) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 3 plus 4?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


# ---------------------------------------------------------------------------------------------------------------
# Packing and the shards


def conversations(n):
    return [{"messages": [{"role": "user", "content": f"Question {i}: " + "word " * (i % 9)},
                          {"role": "assistant", "content": f"Answer {i}. " + "more " * (i % 13)}]} for i in range(n)]


def test_packed_shards(encoder, tmp_path):
    T = 64
    records = conversations(40)
    src = write_jsonl(tmp_path / "c.jsonl", records)
    result = chat_to_shards("--train", src, "--out_dir", tmp_path / "out", "--seq_len", T, "--shard_size", 5 * T)
    assert result.returncode == 0, result.stderr
    paths = sorted((tmp_path / "out").glob("chat_train_*.bin"))
    assert len(paths) > 1  # the stream spans several shards of whole blocks
    encoded = [encoder.encode(r["messages"]) for r in records]
    found = []
    for path in paths:
        tokens, mask = shards.read_shard(path), shards.read_loss_mask(path)
        assert len(tokens) % T == 1 and len(tokens) <= 5 * T + 1
        assert tokens[-1] == 128004 and mask[-1] == 0  # the last position's target: padding, masked
        for block in range(len(tokens) // T):
            t, m = tokens[block * T:(block + 1) * T].tolist(), mask[block * T:(block + 1) * T].tolist()
            assert t[0] == encoder.tok.bos_id  # every row starts a conversation
            # the block is whole conversations, then padding
            starts = [i for i, x in enumerate(t) if x == encoder.tok.bos_id] + [len(t)]
            for a, b in zip(starts, starts[1:]):
                end = b
                while t[end - 1] == 128004:
                    end -= 1
                assert all(x == 128004 for x in t[end:b]) and not any(m[end:b])
                found.append((t[a:end], m[a:end]))
    assert found == [(list(t), list(m)) for t, m in encoded]  # every conversation once, whole, in order


def test_stream_mode_concatenates(encoder, tmp_path):
    records = conversations(7)
    src = write_jsonl(tmp_path / "c.jsonl", records)
    result = chat_to_shards("--val", src, "--out_dir", tmp_path, "--prefix", "s", "--seq_len", 0)
    assert result.returncode == 0, result.stderr
    tokens, mask = shards.read_shard(tmp_path / "s_val_000000.bin"), shards.read_loss_mask(tmp_path / "s_val_000000.bin")
    encoded = [encoder.encode(r["messages"]) for r in records]
    assert tokens.tolist() == [x for t, _ in encoded for x in t]
    assert mask.tolist() == [x for _, m in encoded for x in m]


def test_packed_shards_through_the_cpp_loader(encoder, tmp_path):
    """With -t equal to --seq_len, each loader row is one block: it starts with <|begin_of_text|>, and its targets
    are the block's tokens shifted by one, -1 where the mask is 0."""
    T, B = 48, 2
    src = write_jsonl(tmp_path / "c.jsonl", conversations(30))
    assert chat_to_shards("--train", src, "--out_dir", tmp_path, "--seq_len", T).returncode == 0
    path = tmp_path / "chat_train_000000.bin"
    tokens, mask = shards.read_shard(path).astype(np.int64), shards.read_loss_mask(path)
    nbatches = (len(tokens) - 1) // (B * T)
    binary = REPO / "dev" / "test" / "test_dataloader"
    if not binary.exists():
        pytest.fail(f"{binary} is missing: run `make`")
    result = subprocess.run([str(binary), "run", str(path), str(B), str(T), "0", "1", "0", "0", "128256",
                             str(nbatches)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = [l for l in result.stdout.splitlines() if l.startswith("batch ")]
    assert len(lines) == nbatches
    for k, line in enumerate(lines):
        head, body = line.split(":", 1)
        inputs, targets = (np.array(part.split(), dtype=np.int64) for part in body.split("|"))
        offset = k * B * T
        assert int(head.split()[5]) == offset
        expected = np.where(mask[offset + 1:offset + B * T + 1] == 1, tokens[offset + 1:offset + B * T + 1], -1)
        assert np.array_equal(inputs, tokens[offset:offset + B * T]) and np.array_equal(targets, expected)
        assert int(head.split()[9]) == int((expected >= 0).sum()) > 0
        assert all(inputs[b * T] == encoder.tok.bos_id for b in range(B))


def test_prompt_file(encoder, tmp_path):
    result = chat_to_shards("--out_dir", tmp_path, "--prompt", "What is 1 plus 1?")
    assert result.returncode == 0, result.stderr
    path = tmp_path / "chat_prompt.bin"
    assert shards.read_loss_mask(path) is None
    assert shards.read_shard(path).tolist() == encoder.prompt("What is 1 plus 1?")


BAD_INPUT = {
    "missing role": ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}, "message 0 has no 'role'"),
    "unknown role": ({"messages": [{"role": "bot", "content": "hi"}]}, "unknown role 'bot'"),
    "no content": ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
                   "message 0 (user) has no string 'content'"),
    "no assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    "empty messages": ({"messages": []}, "non-empty list"),
    "no messages key": ({"text": "hi"}, "'messages' list"),
    "message not an object": ({"messages": ["hi"]}, "message 0 is not an object"),
    "not json": ("{'messages': oops", "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_rejected(tmp_path, case):
    record, words = BAD_INPUT[case]
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    src = write_jsonl(tmp_path / "bad.jsonl", [good, record])
    result = chat_to_shards("--train", src, "--out_dir", tmp_path / "out")
    assert result.returncode != 0
    assert f"{src}:2" in result.stderr and words in result.stderr, result.stderr
    assert not list((tmp_path / "out").glob("*.bin"))  # nothing half-written


def test_too_long_and_empty_rejected(tmp_path):
    long = {"messages": [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "a"}]}
    src = write_jsonl(tmp_path / "long.jsonl", [long])
    result = chat_to_shards("--train", src, "--out_dir", tmp_path, "--seq_len", 64)
    assert result.returncode != 0 and f"{src}:1" in result.stderr and "--seq_len 64" in result.stderr
    assert chat_to_shards("--train", src, "--out_dir", tmp_path, "--seq_len", 256).returncode == 0
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    result = chat_to_shards("--train", empty, "--out_dir", tmp_path)
    assert result.returncode != 0 and "no conversations" in result.stderr


# ---------------------------------------------------------------------------------------------------------------
# The shipped chat set (no tokenizer needed)


def test_shipped_chat_set_is_the_script_output(tmp_path):
    result = subprocess.run([sys.executable, str(DATA_SCRIPTS / "make_chat_set.py"), "--out_dir", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for split in ("train", "val"):
        assert (tmp_path / f"chat_{split}.jsonl").read_bytes() == (CHAT_SET / f"chat_{split}.jsonl").read_bytes()
    assert sum(os.path.getsize(CHAT_SET / f"chat_{s}.jsonl") for s in ("train", "val")) < 300_000


def test_shipped_chat_set_is_valid():
    from chat_to_shards import read_conversations, validate_messages

    seen = {}
    for split in ("train", "val"):
        convs = list(read_conversations(str(CHAT_SET / f"chat_{split}.jsonl")))
        for where, messages in convs:
            validate_messages(messages, where)
        seen[split] = {json.dumps(m) for _, m in convs}
        assert len(convs) >= 100
    # answers are computed: spot-check the arithmetic ones
    for split in ("train", "val"):
        for line in (CHAT_SET / f"chat_{split}.jsonl").read_text().splitlines():
            for m in json.loads(line)["messages"]:
                words = m["content"].rstrip(".").split()
                if m["role"] == "assistant" and len(words) == 5 and words[1] in ("plus", "minus", "times"):
                    a, op, b, result = int(words[0]), words[1], int(words[2]), int(words[4])
                    assert result == {"plus": a + b, "minus": a - b, "times": a * b}[op], m["content"]
