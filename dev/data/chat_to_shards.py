"""
Turns chat conversations into token shards with a loss mask, in the Llama 3 Instruct format, for fine-tuning (SFT).

Input: JSON lines, one conversation per line (blank lines skipped, other keys ignored):
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
Roles are system, user and assistant; a conversation needs at least one assistant message (it is what the loss
trains on).

Template (Meta's Llama 3 Instruct chat format, the same tokens as its reference ChatFormat and Hugging Face's
chat template): a conversation is <|begin_of_text|>, then for each message
    <|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>
with CONTENT stripped of leading and trailing whitespace. Special-token text inside CONTENT stays plain text.

Loss mask (dev/data/shards.py has the file layout): 1 on the tokens of each assistant message's CONTENT and on its
<|eot_id|>, 0 on everything else (<|begin_of_text|>, the headers, system and user messages, padding). The trainer
counts only the targets with mask 1, so the model learns to write the answers and to end them, not the questions.

Packing, --seq_len T > 0 (train with the same -t T): conversations are packed greedily, in input order, into blocks
of exactly T tokens; one that does not fit in what is left of a block starts the next block, and the rest is
filled with the pad token 128004 (Llama 3.1's <|finetune_right_pad_id|>; mask 0). A shard holds whole blocks plus
one last pad token (the target of the last position), so every row of a training batch is one block: no
conversation is cut, and every row starts with <|begin_of_text|>. Within a row, attention is plain causal attention
over the whole row: it crosses the boundaries between the packed conversations, as llm.c's pretraining does with
documents, so a conversation may attend to the earlier ones in its row (there is no document mask). A conversation
longer than T tokens is an error.
--seq_len 0: no padding; the conversations follow each other as one stream that the trainer cuts into rows
anywhere, as in pretraining (a conversation may then straddle two rows, and its second part loses its context).

Output: --out_dir/<prefix>_train_000000.bin, ... from --train and <prefix>_val_000000.bin, ... from --val, shards of
at most --shard_size tokens (whole blocks). --prompt TEXT also writes <prefix>_prompt.bin, a plain shard holding
<|begin_of_text|>, the --system message if given, the user message TEXT and the assistant header: what the trainer's
sampler (-A) continues to print an answer.

    python dev/data/chat_to_shards.py --tokenizer PATH/tokenizer.model --train dev/data/chat/chat_train.jsonl \\
        --val dev/data/chat/chat_val.jsonl --out_dir data/chat --seq_len 512 --prompt "What is 12 plus 30?"
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama3_tokenizer import Llama3Tokenizer, resolve_tokenizer_path  # noqa: E402
from shards import MAX_TOKENS, write_shard  # noqa: E402

ROLES = ("system", "user", "assistant")
PAD_ID = 128004  # <|finetune_right_pad_id|> in Llama 3.1 and later (a reserved token in 3.0); never a target


class ChatFormatError(ValueError):
    """A conversation that cannot be encoded; the message names the file, line and field."""


class ChatEncoder:
    """Encodes conversations with the Llama 3 Instruct template into (tokens, loss mask)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        start, end = tokenizer.special_tokens["<|start_header_id|>"], tokenizer.special_tokens["<|end_header_id|>"]
        newlines = tokenizer.encode("\n\n")
        self.headers = {role: [start] + tokenizer.encode(role) + [end] + newlines for role in ROLES}

    def encode(self, messages, where="conversation"):
        """(tokens, mask) of one conversation, as int lists; raises ChatFormatError naming `where`."""
        validate_messages(messages, where)
        tokens, mask = [self.tok.bos_id], [0]
        for message in messages:
            role = message["role"]
            header = self.headers[role]
            body = self.tok.encode(message["content"].strip()) + [self.tok.eot_id]
            tokens += header + body
            mask += [0] * len(header) + [int(role == "assistant")] * len(body)
        return tokens, mask

    def prompt(self, user_text, system_text=None):
        """The tokens that ask for an answer to `user_text`: the conversation so far and the assistant header."""
        messages = ([{"role": "system", "content": system_text}] if system_text else []) + [
            {"role": "user", "content": user_text}]
        tokens = [self.tok.bos_id]
        for message in messages:
            tokens += self.headers[message["role"]] + self.tok.encode(message["content"].strip()) + [self.tok.eot_id]
        return tokens + self.headers["assistant"]


def validate_messages(messages, where):
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(f"{where}: 'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatFormatError(f"{where}: message {i} is not an object")
        if "role" not in message:
            raise ChatFormatError(f"{where}: message {i} has no 'role'")
        if message["role"] not in ROLES:
            raise ChatFormatError(f"{where}: message {i} has unknown role {message['role']!r} "
                                  f"(expected one of {', '.join(ROLES)})")
        if not isinstance(message.get("content"), str):
            raise ChatFormatError(f"{where}: message {i} ({message['role']}) has no string 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatFormatError(f"{where}: no assistant message, so nothing for the loss to train on")


def read_conversations(path):
    """Yields (where, messages) for each conversation of a JSON-lines file."""
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ChatFormatError(f"{where}: not valid JSON: {e}") from None
            if not isinstance(record, dict) or "messages" not in record:
                raise ChatFormatError(f"{where}: expected an object with a 'messages' list")
            yield where, record["messages"]


def pack(conversations, seq_len):
    """Concatenates encoded (where, tokens, mask) conversations into one (tokens, mask) stream: in blocks of
    exactly seq_len tokens padded with PAD_ID when seq_len > 0 (see the top of the file), back to back when 0."""
    tokens, mask = [], []
    for where, conv_tokens, conv_mask in conversations:
        if seq_len > 0:
            if len(conv_tokens) > seq_len:
                raise ChatFormatError(f"{where}: the conversation has {len(conv_tokens)} tokens, more than --seq_len "
                                      f"{seq_len}: shorten it or raise --seq_len")
            room = seq_len - len(tokens) % seq_len
            if len(conv_tokens) > room and room < seq_len:
                tokens += [PAD_ID] * room
                mask += [0] * room
        tokens += conv_tokens
        mask += conv_mask
    if seq_len > 0 and len(tokens) % seq_len:
        room = seq_len - len(tokens) % seq_len
        tokens += [PAD_ID] * room
        mask += [0] * room
    return np.array(tokens, dtype=np.uint32), np.array(mask, dtype=np.uint8)


def write_split(tokens, mask, out_dir, prefix, split, seq_len, shard_size):
    """Writes the stream as shards of at most shard_size tokens; in packed mode each shard is whole blocks plus one
    pad token. Returns the paths."""
    if seq_len > 0:
        per_shard = max(1, shard_size // seq_len) * seq_len
    else:
        per_shard = shard_size
    paths = []
    for start in range(0, len(tokens), per_shard):
        piece, piece_mask = tokens[start:start + per_shard], mask[start:start + per_shard]
        if seq_len > 0:
            piece = np.append(piece, np.uint32(PAD_ID))
            piece_mask = np.append(piece_mask, np.uint8(0))
        path = os.path.join(out_dir, f"{prefix}_{split}_{len(paths):06d}.bin")
        write_shard(path, piece, piece_mask)
        paths.append(path)
    return paths


def convert(encoder, path, out_dir, prefix, split, seq_len, shard_size):
    encoded = [(where, *encoder.encode(messages, where)) for where, messages in read_conversations(path)]
    if not encoded:
        raise ChatFormatError(f"{path}: no conversations")
    tokens, mask = pack(encoded, seq_len)
    paths = write_split(tokens, mask, out_dir, prefix, split, seq_len, shard_size)
    content = sum(len(t) for _, t, _ in encoded)
    print(f"{split}: {len(encoded)} conversations from {path}: {content} tokens, {int(mask.sum())} of them trained "
          f"(assistant), {len(tokens) - content} padding, in {len(paths)} shard(s)")
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None,
                        help="Llama 3 tokenizer.model (default: $LLAMA3_TOKENIZER, else the repo's copy)")
    parser.add_argument("--train", default=None, help="JSON-lines conversations for the train split")
    parser.add_argument("--val", default=None, help="JSON-lines conversations for the val split")
    parser.add_argument("--out_dir", required=True, help="where the shards go")
    parser.add_argument("--prefix", default="chat", help="shard name prefix")
    parser.add_argument("--seq_len", type=int, default=1024,
                        help="pack into rows of this many tokens (train with -t equal to it); 0: one plain stream")
    parser.add_argument("--shard_size", type=int, default=100_000_000, help="at most this many tokens per shard")
    parser.add_argument("--prompt", default=None, help="also write <prefix>_prompt.bin asking this user question")
    parser.add_argument("--system", default=None, help="system message for --prompt")
    args = parser.parse_args()

    if args.train is None and args.val is None and args.prompt is None:
        sys.exit("error: nothing to do: give --train, --val and/or --prompt")
    if args.seq_len < 0:
        sys.exit(f"error: --seq_len {args.seq_len} must be >= 0")
    if not 1 <= args.shard_size <= MAX_TOKENS - 1:
        sys.exit(f"error: --shard_size {args.shard_size} not in [1, {MAX_TOKENS - 1}]")
    try:
        encoder = ChatEncoder(Llama3Tokenizer(resolve_tokenizer_path(args.tokenizer)))
        os.makedirs(args.out_dir, exist_ok=True)
        for split, path in (("train", args.train), ("val", args.val)):
            if path is not None:
                convert(encoder, path, args.out_dir, args.prefix, split, args.seq_len, args.shard_size)
        if args.prompt is not None:
            prompt_path = os.path.join(args.out_dir, f"{args.prefix}_prompt.bin")
            write_shard(prompt_path, encoder.prompt(args.prompt, args.system))
            print(f"prompt: {prompt_path}")
    except (ChatFormatError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
