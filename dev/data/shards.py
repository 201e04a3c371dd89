"""
Token shards in llm.c's Llama 3 format, read by llmc/dataloader.h.

File layout (little-endian):
    header: 256 int32 (1024 bytes)
        [0] magic 20240801   [1] version 7   [2] number of tokens N   [3] loss-mask flag (0 or 1)   [4..255] zero
    then N uint32 token ids
    then, only when the flag is 1, the loss mask: N uint8, 1 where token i is a target the loss counts, else 0
so a plain shard (llm.c's format) is exactly 1024 + 4 N bytes and a masked one 1024 + 5 N bytes. The trainer turns
a target whose mask is 0 into -1 (ignored by the loss); plain shards count every target.
"""

import os

import numpy as np

SHARD_MAGIC = 20240801
SHARD_VERSION = 7
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKENS = 2**31 - 1  # the count is an int32


def make_header(num_tokens, magic=SHARD_MAGIC, version=SHARD_VERSION, masked=False):
    """The 256-int32 header for a shard of `num_tokens` tokens (magic/version overridable to make bad files)."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = magic
    header[1] = version
    header[2] = num_tokens
    header[3] = int(masked)
    return header


def write_shard(path, tokens, mask=None):
    """Writes `tokens` (any integer sequence in [0, 2^32)) as a shard, with a loss mask (a sequence of 0/1, one per
    token) when `mask` is given. Writes to path.tmp then renames, so a reader never sees a half-written shard."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if len(tokens) > MAX_TOKENS:
        raise ValueError(f"{len(tokens)} tokens do not fit one shard (at most {MAX_TOKENS})")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2^32)")
    if mask is not None:
        mask = np.asarray(mask)
        if mask.shape != tokens.shape:
            raise ValueError(f"loss mask of shape {mask.shape} for tokens of shape {tokens.shape}")
        if len(mask) and (mask.min() < 0 or mask.max() > 1):
            raise ValueError("loss mask values must be 0 or 1")
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(make_header(len(tokens), masked=mask is not None).tobytes())
        f.write(tokens.astype("<u4").tobytes())
        if mask is not None:
            f.write(mask.astype(np.uint8).tobytes())
    os.replace(tmp, path)


def read_header_and_flag(path):
    """(token count, has a loss mask) of a shard after checking magic, version, flag and the file size."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte shard header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise ValueError(f"{path}: magic {header[0]}, expected {SHARD_MAGIC} (not a Llama 3 token shard)")
    if header[1] != SHARD_VERSION:
        raise ValueError(f"{path}: version {header[1]}, expected {SHARD_VERSION}")
    if header[3] not in (0, 1):
        raise ValueError(f"{path}: loss-mask flag {header[3]} in header slot 3, expected 0 or 1")
    num_tokens, masked = int(header[2]), bool(header[3])
    expected = HEADER_BYTES + (5 if masked else 4) * num_tokens
    if num_tokens < 0 or size != expected:
        what = "tokens and their loss mask" if masked else "tokens"
        raise ValueError(f"{path}: {size} bytes, but the header's {num_tokens} {what} need {expected}")
    return num_tokens, masked


def read_header(path):
    """Returns the token count of a shard after checking magic, version, flag and the file size."""
    return read_header_and_flag(path)[0]


def read_shard(path):
    """The tokens of a shard as a uint32 array (validated as in read_header)."""
    num_tokens = read_header(path)
    return np.fromfile(path, dtype="<u4", count=num_tokens, offset=HEADER_BYTES)


def read_loss_mask(path):
    """The loss mask of a shard as a uint8 array, or None for a plain shard (every target counts)."""
    num_tokens, masked = read_header_and_flag(path)
    if not masked:
        return None
    mask = np.fromfile(path, dtype=np.uint8, count=num_tokens, offset=HEADER_BYTES + 4 * num_tokens)
    if len(mask) and mask.max() > 1:
        raise ValueError(f"{path}: loss-mask byte {mask.max()} (must be 0 or 1)")
    return mask


class ShardWriter:
    """Collects a stream of tokens into files `<prefix>_<split>_000000.bin`, `..._000001.bin`, ... of `shard_size`
    tokens each (the last one may be shorter). Documents may straddle two shards, as in llm.c."""

    def __init__(self, out_dir, prefix, split, shard_size):
        if shard_size < 1 or shard_size > MAX_TOKENS:
            raise ValueError(f"shard_size {shard_size} not in [1, {MAX_TOKENS}]")
        self.out_dir, self.prefix, self.split, self.shard_size = out_dir, prefix, split, shard_size
        self.buffer = np.empty(shard_size, dtype=np.uint32)
        self.filled = 0
        self.paths = []
        self.num_tokens = 0

    def add(self, tokens):
        tokens = np.asarray(tokens, dtype=np.uint32)
        while len(tokens):
            take = min(len(tokens), self.shard_size - self.filled)
            self.buffer[self.filled : self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.shard_size:
                self._flush()

    def close(self):
        """Writes the last, partial shard; returns the list of paths written."""
        if self.filled:
            self._flush()
        return self.paths

    def _flush(self):
        name = f"{self.prefix}_{self.split}_{len(self.paths):06d}.bin"
        path = os.path.join(self.out_dir, name)
        write_shard(path, self.buffer[: self.filled])
        self.paths.append(path)
        self.num_tokens += self.filled
        self.filled = 0
