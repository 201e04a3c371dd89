"""
Tokenizes text with the Llama 3 tokenizer into llm.c-style shards (format: dev/data/shards.py).

Input (--input): a text file, a JSON-lines file (one object per line, its text under --text_key), or a directory,
whose .txt and .jsonl files are read in sorted path order (subdirectories included).

Documents: a JSON line is one document. A text file is cut into paragraphs at blank lines ("\\n\\n"), each keeping the
"\\n\\n" that ended it, as dev/data/tinyshakespeare.py does; --txt_documents file makes each text file one document.
Every document becomes <|begin_of_text|> followed by its tokens, and documents follow each other in input order.

Output: --out_dir/<prefix>_val_000000.bin, ..., <prefix>_train_000000.bin, ... of --shard_size tokens each (the last
of each split may be shorter; a document may straddle two shards). Validation is either
  - the first --shard_size tokens of the stream (the default, --val_fraction 0, as llm.c's fineweb script does), or
  - with --val_fraction F > 0, each document independently with probability F (seeded by --seed, so reproducible).

    python dev/data/text_to_shards.py --tokenizer PATH/tokenizer.model --input corpus.jsonl --out_dir data/corpus
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama3_tokenizer import resolve_tokenizer_path  # noqa: E402
from parallel_encode import encode_documents  # noqa: E402
from shards import ShardWriter  # noqa: E402

READ_CHUNK_CHARS = 1 << 20


def is_jsonl(path):
    return path.endswith(".jsonl") or path.endswith(".json")


def input_files(path):
    """The files to read, in order."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        sys.exit(f"error: input '{path}' is neither a file nor a directory")
    files = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        files += [os.path.join(root, n) for n in names if n.endswith(".txt") or n.endswith(".jsonl")]
    files.sort()
    if not files:
        sys.exit(f"error: no .txt or .jsonl files under '{path}'")
    return files


def jsonl_documents(path, text_key):
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"error: {path}:{lineno}: not valid JSON: {e}")
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                sys.exit(f"error: {path}:{lineno}: no string field '{text_key}' (set --text_key)")
            yield record[text_key]


def paragraph_documents(path):
    """The blank-line paragraphs of a text file, read in chunks so that a file of any size streams. Cutting the
    buffer at each "\\n\\n" it holds gives the same pieces as text.split("\\n\\n") on the whole file."""
    with open(path, "r", encoding="utf-8") as f:
        pending = None  # the previous paragraph, yielded once we know whether it is the last
        buffer = ""
        while True:
            chunk = f.read(READ_CHUNK_CHARS)
            if not chunk:
                break
            parts = (buffer + chunk).split("\n\n")
            buffer = parts.pop()
            for part in parts:
                if pending is not None:
                    yield pending + "\n\n"
                pending = part
        if pending is not None:
            yield pending + "\n\n"
        if buffer:
            yield buffer


def whole_file_document(path):
    with open(path, "r", encoding="utf-8") as f:
        yield f.read()


def documents(files, text_key, txt_documents):
    for path in files:
        if is_jsonl(path):
            yield from jsonl_documents(path, text_key)
        elif txt_documents == "file":
            yield from whole_file_document(path)
        else:
            yield from paragraph_documents(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None,
                        help="Llama 3 tokenizer.model (default: $LLAMA3_TOKENIZER, else the repo's copy)")
    parser.add_argument("--input", required=True, help="a .txt or .jsonl file, or a directory of them")
    parser.add_argument("--out_dir", required=True, help="where the shards go")
    parser.add_argument("--prefix", default=None, help="shard name prefix (default: the input's base name)")
    parser.add_argument("--text_key", default="text", help="JSON field that holds a document's text")
    parser.add_argument("--txt_documents", choices=["paragraph", "file"], default="paragraph",
                        help="a .txt file's documents: its blank-line paragraphs, or the whole file")
    parser.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per shard")
    parser.add_argument("--val_fraction", type=float, default=0.0,
                        help="share of documents for validation; 0 makes the first shard the validation split")
    parser.add_argument("--seed", type=int, default=1337, help="seeds the choice of validation documents")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="tokenizer processes")
    args = parser.parse_args()

    if not 0.0 <= args.val_fraction < 1.0:
        sys.exit(f"error: --val_fraction {args.val_fraction} not in [0, 1)")
    try:
        tokenizer_path = resolve_tokenizer_path(args.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    files = input_files(args.input)
    prefix = args.prefix or os.path.splitext(os.path.basename(os.path.normpath(args.input)))[0]
    os.makedirs(args.out_dir, exist_ok=True)

    val = ShardWriter(args.out_dir, prefix, "val", args.shard_size)
    train = ShardWriter(args.out_dir, prefix, "train", args.shard_size)
    choose = random.Random(args.seed)
    docs = documents(files, args.text_key, args.txt_documents)

    num_docs = 0
    for tokens in encode_documents(docs, tokenizer_path, args.workers, desc=prefix):
        num_docs += 1
        if args.val_fraction > 0:
            (val if choose.random() < args.val_fraction else train).add(tokens)
        else:
            # the stream fills the validation shard first, then the training shards
            room = args.shard_size - val.filled if not val.paths else 0
            val.add(tokens[:room])
            train.add(tokens[room:])

    val_paths, train_paths = val.close(), train.close()
    print(f"{num_docs} documents from {len(files)} file(s)")
    print(f"val:   {val.num_tokens} tokens in {len(val_paths)} shard(s)")
    print(f"train: {train.num_tokens} tokens in {len(train_paths)} shard(s)")
    if not train_paths:
        print("warning: no training tokens (the input fits in the validation split)", file=sys.stderr)


if __name__ == "__main__":
    main()
