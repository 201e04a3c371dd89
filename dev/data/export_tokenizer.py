"""
Exports the Llama 3 tokenizer to a .bin that llmc/tokenizer.h reads, so C++ can turn sampled ids back into text.

File layout (little-endian):
    header: 16 int32 (64 bytes)
        [0] magic 20261125   [1] version 1   [2] vocab size V, special tokens included (128256)
        [3] <|begin_of_text|> id   [4] <|end_of_text|> id   [5] <|eot_id|> id
        [6] total bytes of all token strings   [7..15] zero
    then for each id 0..V-1: uint32 length, then that many bytes
A token's bytes are its raw BPE bytes (not necessarily valid UTF-8 on their own), or a special token's name in UTF-8.
The file is exactly 64 + 4 V + header[6] bytes; the reader checks that.

    python dev/data/export_tokenizer.py --tokenizer PATH/tokenizer.model --out tokenizer.bin
"""

import argparse
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOKENIZER_MAGIC = 20261125
TOKENIZER_VERSION = 1
HEADER_INTS = 16


def write_tokenizer(out_path, pieces, bos_id, eos_id, eot_id):
    """The file llmc/tokenizer.h reads: pieces[i] is id i's bytes. Written to a temporary file, then renamed."""
    header = [0] * HEADER_INTS
    header[:7] = [TOKENIZER_MAGIC, TOKENIZER_VERSION, len(pieces), bos_id, eos_id, eot_id, sum(len(p) for p in pieces)]
    tmp = str(out_path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack(f"<{HEADER_INTS}i", *header))
        for piece in pieces:
            f.write(struct.pack("<I", len(piece)))
            f.write(piece)
    os.replace(tmp, out_path)
    return out_path


def byte_pieces(vocab):
    """A stand-in vocabulary for tests: ids below 256 are their byte, the others named <|special i|>."""
    return [bytes([i]) if i < 256 else f"<|special {i}|>".encode() for i in range(vocab)]


def export(tokenizer, out_path):
    pieces = [tokenizer.token_bytes(i) for i in range(tokenizer.n_words)]
    write_tokenizer(out_path, pieces, tokenizer.bos_id, tokenizer.eos_id, tokenizer.eot_id)
    return len(pieces)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None,
                        help="Llama 3 tokenizer.model (default: $LLAMA3_TOKENIZER, else the repo's copy)")
    parser.add_argument("--out", required=True, help="the .bin to write")
    args = parser.parse_args()
    from llama3_tokenizer import Llama3Tokenizer  # tiktoken: only for the real tokenizer, not for write_tokenizer

    try:
        tokenizer = Llama3Tokenizer(args.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    n = export(tokenizer, args.out)
    print(f"wrote {n} tokens to {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
