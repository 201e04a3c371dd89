"""
The Llama 3 tokenizer, loaded from a local `tokenizer.model` with tiktoken.

tokenizer.model is the file Meta ships: one line per BPE token, `base64(bytes) rank`, ranks 0..127999.
The 256 special tokens (ids 128000..128255) and the pre-tokenization regex are not in that file; they are
defined here the way Meta's llama3 reference tokenizer.py defines them, so ids agree with the released models.

The path comes from the caller (a --tokenizer flag), else from the LLAMA3_TOKENIZER environment variable, else it is
the copy the repo ships, dev/data/llama3/tokenizer.model (with Meta's license and notice beside it).

    tok = Llama3Tokenizer("path/to/tokenizer.model")
    ids = tok.encode("Hello world", bos=True)   # [128000, 9906, 1917]
    tok.decode(ids)                             # "<|begin_of_text|>Hello world"
"""

import base64
import os
import re

import tiktoken

# Splits text into the pieces that BPE merges within (words with a leading space, runs of up to 3 digits, ...).
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NUM_BASE_TOKENS = 128000
NUM_SPECIAL_TOKENS = 256


def special_token_names():
    """The 256 special tokens in id order (the first gets id 128000)."""
    named = [
        "<|begin_of_text|>",  # 128000
        "<|end_of_text|>",  # 128001
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",  # 128006
        "<|end_header_id|>",  # 128007
        "<|reserved_special_token_4|>",
        "<|eot_id|>",  # 128009, end of a chat turn
    ]
    # the remaining slots are reserved tokens numbered on from 5
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(5, NUM_SPECIAL_TOKENS - 5)]
    names = named + reserved
    assert len(names) == NUM_SPECIAL_TOKENS
    return names


# tiktoken's Rust core can be very slow on huge inputs and on long runs with no split point, so long texts are
# cut before encoding: at most this many characters per call, and no run of only-whitespace or only-non-whitespace
# characters longer than the second limit. Ordinary prose is never cut.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_RUN_CHARS + 1, MAX_RUN_CHARS + 1))


def _split_long_text(text):
    """Yields pieces of `text` that are safe to hand to tiktoken one at a time; their concatenation is `text`."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        window = text[start : start + MAX_ENCODE_CHARS]
        if len(window) <= MAX_RUN_CHARS:  # too short to hold a long run: the common case, no scan needed
            yield window
            continue
        cut = 0
        for run in _LONG_RUN.finditer(window):
            for i in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield window[cut:i]
                cut = i
        yield window[cut:]


DEFAULT_TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama3", "tokenizer.model")


def resolve_tokenizer_path(path=None):
    """The tokenizer.model path: the argument if given, else $LLAMA3_TOKENIZER, else the repo's copy."""
    path = path or os.environ.get("LLAMA3_TOKENIZER") or DEFAULT_TOKENIZER
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return path


def load_bpe_ranks(path):
    """Reads tokenizer.model into {token bytes: rank}; checks that the ranks are exactly 0..N-1."""
    ranks = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'base64 rank', got {line[:60]!r}")
            ranks[base64.b64decode(parts[0])] = int(parts[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: BPE ranks are not the contiguous range 0..{len(ranks) - 1}")
    return ranks


class Llama3Tokenizer:
    def __init__(self, model_path=None):
        model_path = resolve_tokenizer_path(model_path)
        ranks = load_bpe_ranks(model_path)
        if len(ranks) != NUM_BASE_TOKENS:
            raise ValueError(f"{model_path}: {len(ranks)} BPE tokens, expected {NUM_BASE_TOKENS} for Llama 3")
        self.special_tokens = {name: NUM_BASE_TOKENS + i for i, name in enumerate(special_token_names())}
        self.model = tiktoken.Encoding(
            name=os.path.basename(model_path),
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words = self.model.n_vocab  # 128256
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.eot_id = self.special_tokens["<|eot_id|>"]

    def encode(self, text, bos=False, eos=False):
        """Token ids of `text`. Special-token text in the input ("<|eot_id|>") is encoded as plain text, never as the
        special id, so untrusted data cannot inject control tokens; use bos/eos to add them."""
        ids = [self.bos_id] if bos else []
        for piece in _split_long_text(text):
            ids.extend(self.model.encode_ordinary(piece))
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts, bos=False, eos=False):
        """encode() of each text; short texts go through tiktoken's threaded batch call, with the same result."""
        if all(len(t) <= MAX_RUN_CHARS for t in texts):
            bodies = self.model.encode_ordinary_batch(texts)
        else:
            bodies = [self.encode(t) for t in texts]
        head = [self.bos_id] if bos else []
        tail = [self.eos_id] if eos else []
        return [head + body + tail for body in bodies]

    def decode(self, ids):
        """Text of `ids` (special ids become their names); bytes that are not valid UTF-8 become U+FFFD."""
        return self.model.decode(list(ids))

    def decode_bytes(self, ids):
        """The exact bytes of `ids`, the same bytes the C decoder (llmc/tokenizer.h) produces."""
        return self.model.decode_bytes(list(ids))

    def token_bytes(self, token_id):
        """The bytes of one token (a special token's bytes are its UTF-8 name)."""
        return self.model.decode_single_token_bytes(token_id)
