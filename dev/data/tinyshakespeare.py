"""
Tokenizes tiny shakespeare with the Llama 3 tokenizer into llm.c-style shards:
    <out_dir>/tiny_shakespeare_val.bin and <out_dir>/tiny_shakespeare_train.bin

The corpus is read from a local file: --input, else $TINYSHAKESPEARE_TXT, else the copy the repo ships
(dev/data/tinyshakespeare.txt). It is downloaded only when --url is given (and then saved to
<out_dir>/tiny_shakespeare.txt).

Documents: the text is cut at blank lines ("\\n\\n"), so each speaker's paragraph is one document, as llm.c does.
Every document is <|begin_of_text|> followed by its text; the text keeps the "\\n\\n" that ended it (all but the last
document), so the token stream with the BOS ids removed decodes back to the exact corpus.

Split: validation is the first whole documents, as few as reach --val_tokens tokens (default 32768, the size of
llm.c's split, about 10% of the corpus); training is all the rest. Cutting between documents keeps every validation
document whole.

    python dev/data/tinyshakespeare.py --tokenizer PATH/tokenizer.model --input PATH/tinyshakespeare.txt
"""

import argparse
import os
import sys
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama3_tokenizer import Llama3Tokenizer  # noqa: E402
from shards import write_shard  # noqa: E402


def split_documents(text):
    """The documents of a corpus: paragraphs cut at "\\n\\n", each but the last keeping its "\\n\\n" (a text that
    ends in "\\n\\n" has no empty last document)."""
    paragraphs = text.split("\n\n")
    documents = [p + "\n\n" for p in paragraphs[:-1]]
    if paragraphs[-1]:
        documents.append(paragraphs[-1])
    return documents


def split_val_train(doc_tokens, val_tokens):
    """(val, train) uint32 arrays: the fewest leading documents with >= val_tokens tokens, then the rest."""
    num_val_docs, count = 0, 0
    while num_val_docs < len(doc_tokens) and count < val_tokens:
        count += len(doc_tokens[num_val_docs])
        num_val_docs += 1
    flat = lambda docs: np.array([t for d in docs for t in d], dtype=np.uint32)  # noqa: E731
    return flat(doc_tokens[:num_val_docs]), flat(doc_tokens[num_val_docs:]), num_val_docs


DEFAULT_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tinyshakespeare.txt")


def read_corpus(args):
    path = args.input or os.environ.get("TINYSHAKESPEARE_TXT")
    if not path and args.url:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "tiny_shakespeare.txt")
        print(f"downloading {args.url} -> {path}")
        urllib.request.urlretrieve(args.url, path)
    path = path or DEFAULT_CORPUS
    if not os.path.isfile(path):
        sys.exit(f"error: corpus file not found: {path}")
    with open(path, "r", encoding="utf-8") as f:
        return f.read()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="Llama 3 tokenizer.model (default: $LLAMA3_TOKENIZER, "
                        "else dev/data/llama3/tokenizer.model)")
    parser.add_argument("--input", default=None,
                        help="tiny shakespeare text (default: $TINYSHAKESPEARE_TXT, else dev/data/tinyshakespeare.txt)")
    parser.add_argument("--url", default=None, help="download the corpus from here if no local file is given")
    parser.add_argument("--out_dir", default="data/tinyshakespeare", help="where the two .bin shards go")
    parser.add_argument("--val_tokens", type=int, default=32768, help="validation split size, whole documents")
    args = parser.parse_args()

    try:
        tokenizer = Llama3Tokenizer(args.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    text = read_corpus(args)
    documents = split_documents(text)
    doc_tokens = tokenizer.encode_batch(documents, bos=True)
    val, train, num_val_docs = split_val_train(doc_tokens, args.val_tokens)

    os.makedirs(args.out_dir, exist_ok=True)
    val_path = os.path.join(args.out_dir, "tiny_shakespeare_val.bin")
    train_path = os.path.join(args.out_dir, "tiny_shakespeare_train.bin")
    write_shard(val_path, val)
    write_shard(train_path, train)
    print(f"{len(documents)} documents, {len(val) + len(train)} tokens")
    print(f"val:   {len(val)} tokens ({num_val_docs} documents) -> {val_path}")
    print(f"train: {len(train)} tokens ({len(documents) - num_val_docs} documents) -> {train_path}")


if __name__ == "__main__":
    main()
