"""
Token shards in llm.c's Llama 3 format, read by llmc/dataloader.h.

File layout (little-endian):
    header: 256 int32 (1024 bytes)
        [0] magic 20240801   [1] version 7   [2] number of tokens N   [3..255] zero
    then N uint32 token ids
so a valid shard is exactly 1024 + 4 N bytes.
"""

import os

import numpy as np

SHARD_MAGIC = 20240801
SHARD_VERSION = 7
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKENS = 2**31 - 1  # the count is an int32


def make_header(num_tokens, magic=SHARD_MAGIC, version=SHARD_VERSION):
    """The 256-int32 header for a shard of `num_tokens` tokens (magic/version overridable to make bad files)."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = magic
    header[1] = version
    header[2] = num_tokens
    return header


def write_shard(path, tokens):
    """Writes `tokens` (any integer sequence in [0, 2^32)) as a shard. Writes to path.tmp then renames, so a
    reader never sees a half-written shard."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if len(tokens) > MAX_TOKENS:
        raise ValueError(f"{len(tokens)} tokens do not fit one shard (at most {MAX_TOKENS})")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2^32)")
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(make_header(len(tokens)).tobytes())
        f.write(tokens.astype("<u4").tobytes())
    os.replace(tmp, path)


def read_header(path):
    """Returns the token count of a shard after checking magic, version and the file size."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ValueError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte shard header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise ValueError(f"{path}: magic {header[0]}, expected {SHARD_MAGIC} (not a Llama 3 token shard)")
    if header[1] != SHARD_VERSION:
        raise ValueError(f"{path}: version {header[1]}, expected {SHARD_VERSION}")
    num_tokens = int(header[2])
    if num_tokens < 0 or size != HEADER_BYTES + 4 * num_tokens:
        raise ValueError(f"{path}: {size} bytes, but the header's {num_tokens} tokens need {HEADER_BYTES + 4 * num_tokens}")
    return num_tokens


def read_shard(path):
    """The tokens of a shard as a uint32 array (validated as in read_header)."""
    num_tokens = read_header(path)
    return np.fromfile(path, dtype="<u4", count=num_tokens, offset=HEADER_BYTES)


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
