"""
Tokenizes the English documentation sources that three Debian packages install into llm.c-style shards (format:
dev/data/shards.py): about 11M Llama 3 tokens of technical English prose, a real corpus for the convergence test.

Sources, read where apt installs them (under --root, default /); --packages picks some of them:
    linux-doc    usr/share/doc/linux-doc/Documentation: the Linux kernel's reStructuredText (.rst) and text (.txt)
                 documents, most of them gzip-compressed (.gz); the translations/ directory is left out
    python3-doc  usr/share/doc/python3-doc/html/_sources: the reStructuredText of the Python manual (.rst.txt)
    perl-doc     usr/share/perl/5.*/pod: the Perl manual (.pod), less the generated table of contents (perltoc), the
                 Unicode property tables (perluniprops) and the Chinese, Japanese and Korean pages
A package counts as installed when its /usr/share/doc/<package> is there (every Debian package has one). When one
is missing the script stops and prints the apt-get command that installs it.

Documents: each file is one document, <|begin_of_text|> followed by its text (read as UTF-8, decompressed first
when it is a .gz file). Its name is <package>/<path in the source directory, less .gz>, e.g.
linux-doc/admin-guide/README.rst.

Order and split: the documents go in the order of the SHA-256 of their names, a fixed shuffle that interleaves the
packages and their topics. A model trained front to back (a loader without shuffling, as scripts/convergence.py
runs both trainers) then sees all three packages all along, and a val loss taken on the val split's first batches
is one on a sample of all three: in package order the stream ended on Perl's manual while the first val batches
were the kernel's, and the final val loss swung by percents with what the last steps had read. Validation is the
first documents in that order, as few as reach --val_tokens tokens; training is all the others, in the same order.
The order and the split depend on the names alone (not on --root, the machine or the number of workers), and a
document keeps its side when other documents come or go.

Output: --out_dir/debian_docs_val_000000.bin, ... and debian_docs_train_000000.bin, ... of --shard_tokens tokens each
(the last of each split may be shorter); shards an earlier run left there are removed first. The tokens are held
in memory until the split is known (4 bytes a token).

Tokenizing runs in --workers processes (default: one per CPU), which also read the files, with a progress bar on
stderr; the shards are the same whatever the number of workers.

    python dev/data/debian_docs.py --out_dir data/debian_docs
"""

import argparse
import glob
import gzip
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama3_tokenizer import resolve_tokenizer_path  # noqa: E402
from parallel_encode import encode_documents  # noqa: E402
from shards import MAX_TOKENS, ShardWriter  # noqa: E402

PREFIX = "debian_docs"

# package: (its text directory under the root, a glob; the file name endings read; subdirectories and files left out)
SOURCES = {
    "linux-doc": ("usr/share/doc/linux-doc/Documentation", (".rst", ".txt", ".rst.gz", ".txt.gz"), {"translations"}),
    "python3-doc": ("usr/share/doc/python3-doc/html/_sources", (".rst.txt",), set()),
    "perl-doc": ("usr/share/perl/5.*/pod", (".pod",),
                 {"perltoc.pod", "perluniprops.pod", "perlcn.pod", "perljp.pod", "perlko.pod", "perltw.pod"}),
}


def source_directory(root, package):
    """The directory holding `package`'s texts, or None when the package is not installed."""
    if not os.path.isdir(os.path.join(root, "usr/share/doc", package)):
        return None
    pattern = SOURCES[package][0]
    # by real path: perl's 5.36 is a symlink to 5.36.0, one directory
    found = sorted({os.path.realpath(p) for p in glob.glob(os.path.join(root, pattern))})
    if len(found) != 1:
        sys.exit(f"error: {package} is installed, but {len(found)} directories match {os.path.join(root, pattern)}: "
                 f"{found} (expected one)")
    return found[0]


def package_documents(package, directory):
    """(name, path) of each of the package's documents, sorted by name."""
    _, endings, left_out = SOURCES[package]
    documents = []
    for parent, subdirs, files in os.walk(directory):
        subdirs[:] = [d for d in subdirs if d not in left_out]
        for file in files:
            if file.endswith(endings) and file not in left_out:
                path = os.path.join(parent, file)
                relative = os.path.relpath(path, directory).replace(os.sep, "/")
                documents.append((f"{package}/{relative.removesuffix('.gz')}", path))
    return sorted(documents)


def read_document(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 ({e})") from None


def hash_order(names):
    """The document indices in the order of the SHA-256 of their names."""
    return sorted(range(len(names)), key=lambda i: hashlib.sha256(names[i].encode("utf-8")).hexdigest())


def choose_val(order, doc_tokens, val_tokens):
    """The indices of the validation documents: the first in `order`, as few as reach val_tokens tokens."""
    val, count = set(), 0
    for i in order:
        if count >= val_tokens:
            break
        val.add(i)
        count += len(doc_tokens[i])
    return val


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None,
                        help="Llama 3 tokenizer.model (default: $LLAMA3_TOKENIZER, else the repo's copy)")
    parser.add_argument("--packages", nargs="+", choices=list(SOURCES), default=list(SOURCES),
                        help="the packages to read (default: all)")
    parser.add_argument("--root", default="/", help="where the packages are installed")
    parser.add_argument("--out_dir", default="data/debian_docs", help="where the shards go")
    parser.add_argument("--val_tokens", type=int, default=500_000, help="validation split size, whole documents")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    args = parser.parse_args()

    if args.val_tokens < 0 or not 1 <= args.shard_tokens <= MAX_TOKENS or args.workers < 1:
        sys.exit("error: --val_tokens must be >= 0, --shard_tokens in [1, 2^31 - 1] and --workers >= 1")
    try:
        tokenizer_path = resolve_tokenizer_path(args.tokenizer)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    packages = [p for p in SOURCES if p in args.packages]
    directories = {p: source_directory(args.root, p) for p in packages}
    missing = [p for p in packages if directories[p] is None]
    if missing:
        sys.exit(f"error: the Debian package(s) {', '.join(missing)} are not installed (no "
                 f"{', '.join(os.path.join(args.root, 'usr/share/doc', p) for p in missing)}); install them with\n"
                 f"    sudo apt-get install {' '.join(missing)}")

    documents = []
    for package in packages:
        found = package_documents(package, directories[package])
        if not found:
            sys.exit(f"error: {package} is installed, but {directories[package]} holds no documents")
        documents += found
    names = [name for name, _ in documents]
    start = time.monotonic()
    try:
        doc_tokens = list(encode_documents([path for _, path in documents], tokenizer_path, args.workers,
                                           desc=PREFIX, total=len(documents), load=read_document, chunksize=8))
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    seconds = time.monotonic() - start
    order = hash_order(names)
    val = choose_val(order, doc_tokens, args.val_tokens)

    os.makedirs(args.out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(args.out_dir, f"{PREFIX}_*_*.bin")):
        os.remove(old)
    writers = {split: ShardWriter(args.out_dir, PREFIX, split, args.shard_tokens) for split in ("val", "train")}
    for i in order:
        writers["val" if i in val else "train"].add(doc_tokens[i])
    paths = {split: writer.close() for split, writer in writers.items()}

    for package in packages:
        indices = [i for i, name in enumerate(names) if name.startswith(package + "/")]
        print(f"{package}: {len(indices)} documents, {sum(len(doc_tokens[i]) for i in indices)} tokens "
              f"from {directories[package]}")
    total = sum(len(t) for t in doc_tokens)
    print(f"{len(documents)} documents, {total} tokens in {seconds:.1f} s ({total / seconds:,.0f} tokens/s, "
          f"{args.workers} workers)")
    for split, writer in writers.items():
        count = len(val) if split == "val" else len(documents) - len(val)
        print(f"{split + ':':6} {writer.num_tokens} tokens ({count} documents) in {len(paths[split])} shard(s): "
              f"{', '.join(paths[split])}")
    if not paths["train"]:
        print("warning: no training tokens (all documents fit in --val_tokens)", file=sys.stderr)


if __name__ == "__main__":
    main()
