"""
Encodes documents with the Llama 3 tokenizer in several processes, with a progress bar: the tokenizing loop that
dev/data/text_to_shards.py and dev/data/debian_docs.py share.

Each document becomes <|begin_of_text|> followed by its tokens, as a uint32 array. The arrays come back in input
order (Pool.imap), so the output does not depend on the number of processes. Each worker process loads the
tokenizer once. The items handed out are either the texts themselves or, with `load`, something a worker turns into
the text (a path it reads, say, so that reading and decompressing run in parallel too).

    for tokens in encode_documents(texts, tokenizer_path, workers=4, desc="corpus"):
        ...
"""

import multiprocessing
import time

import numpy as np
from tqdm import tqdm

from llama3_tokenizer import Llama3Tokenizer

_worker_tokenizer = None
_worker_load = None


def _init_worker(tokenizer_path, load):
    global _worker_tokenizer, _worker_load
    _worker_tokenizer = Llama3Tokenizer(tokenizer_path)
    _worker_load = load


def _encode_document(item):
    text = _worker_load(item) if _worker_load is not None else item
    return np.array(_worker_tokenizer.encode(text, bos=True), dtype=np.uint32)


def encode_documents(items, tokenizer_path, workers, desc, total=None, load=None, chunksize=64):
    """Yields the tokens of each document (<|begin_of_text|> + its text's ids, a uint32 array) in the order of
    `items`, encoded by `workers` processes (1: in this process). `load(item)`, if given, gives a document's text
    (it runs in the workers and must be a module-level function); else the items are the texts. `chunksize` items
    go to a worker at a time. A progress bar on stderr counts the documents (out of `total` when it is known) and
    shows the tokens and tokens/s."""
    if workers > 1:
        pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path, load))
        encoded = pool.imap(_encode_document, items, chunksize=chunksize)
    else:
        pool = None
        _init_worker(tokenizer_path, load)
        encoded = map(_encode_document, items)
    try:
        num_tokens = 0
        start = time.monotonic()
        with tqdm(total=total, unit="doc", desc=desc) as progress:
            for tokens in encoded:
                num_tokens += len(tokens)
                rate = num_tokens / max(time.monotonic() - start, 1e-9)
                progress.set_postfix_str(f"{tqdm.format_sizeof(num_tokens)} tok, {tqdm.format_sizeof(rate)} tok/s",
                                         refresh=False)
                progress.update()
                yield tokens
    finally:
        if pool is not None:
            pool.terminate()
