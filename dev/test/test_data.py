"""
Tests of the data pipeline: the Python shard and tokenizer tools (dev/data/) and the C++ readers
(llmc/dataloader.h, llmc/tokenizer.h) through the test programs dev/test/test_dataloader and dev/test/test_tokenizer,
which `make` builds.

The tests that need the real Llama 3 tokenizer or the tiny shakespeare corpus use the repo's copies
(dev/data/llama3/tokenizer.model, dev/data/tinyshakespeare.txt), or the files LLAMA3_TOKENIZER and TINYSHAKESPEARE_TXT
name.
"""

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DATA_SCRIPTS = REPO / "dev" / "data"
sys.path.insert(0, str(DATA_SCRIPTS))

import shards  # noqa: E402

# What dev/data/tinyshakespeare.py makes of the corpus (measured; README.md quotes the same numbers).
TINYSHAKESPEARE_DOCS = 7222
TINYSHAKESPEARE_VAL_TOKENS = 32806
TINYSHAKESPEARE_TRAIN_TOKENS = 276186

# Test shards for the dataloader: token i of shard s is (s+1)*1000000 + i, which test_dataloader checks.
SIZES = [1000, 1537, 777]
BIG_VOCAB = 1 << 24


def binary(name):
    path = REPO / "dev" / "test" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make` in {REPO} to build the C++ test programs")
    return str(path)


def run(args, **kwargs):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)


def run_ok(args):
    result = run(args)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def write_rule_shards(directory, sizes=SIZES):
    for s, n in enumerate(sizes):
        shards.write_shard(directory / f"data_{s:02d}.bin", (s + 1) * 1_000_000 + np.arange(n))
    return str(directory / "data_*.bin")


@pytest.fixture
def rule_shards(tmp_path):
    return write_rule_shards(tmp_path)


def parse_batches(stdout):
    """Lines of `test_dataloader run` as (shard, offset, epoch, inputs, targets)."""
    batches = []
    for line in stdout.splitlines():
        if not line.startswith("batch "):
            continue
        head, body = line.split(":", 1)
        words = head.split()
        inputs, targets = body.split("|")
        batches.append((int(words[3]), int(words[5]), int(words[7]),
                        [int(x) for x in inputs.split()], [int(x) for x in targets.split()]))
    return batches


def loader_args(pattern, B=2, T=4, rank=0, nproc=1, shuffle=0, seed=0, vocab=BIG_VOCAB, nbatches=1):
    return [binary("test_dataloader"), "run", pattern, B, T, rank, nproc, shuffle, seed, vocab, nbatches]


# ---------------------------------------------------------------------------------------------------------------
# Shards: the Python writer and reader


def test_shard_roundtrip_python(tmp_path):
    tokens = np.array([0, 1, 128000, 128255, 2**32 - 1, 42], dtype=np.int64)
    path = tmp_path / "x.bin"
    shards.write_shard(path, tokens)
    assert os.path.getsize(path) == 1024 + 4 * len(tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:3]) == [20240801, 7, len(tokens)] and not header[3:].any()
    assert np.array_equal(shards.read_shard(path), tokens.astype(np.uint32))
    assert not (tmp_path / "x.bin.tmp").exists()
    with pytest.raises(ValueError):
        shards.write_shard(tmp_path / "neg.bin", [1, -1])
    with pytest.raises(ValueError):
        shards.write_shard(tmp_path / "big.bin", [2**32])


def test_shard_reader_rejects_bad_files(tmp_path):
    path = tmp_path / "x.bin"
    shards.write_shard(path, np.arange(10))
    data = path.read_bytes()
    path.write_bytes(data[:-4])
    with pytest.raises(ValueError, match="x.bin"):
        shards.read_shard(path)
    path.write_bytes(shards.make_header(10, magic=1234).tobytes() + data[1024:])
    with pytest.raises(ValueError, match="magic"):
        shards.read_shard(path)


def test_shard_writer_splits_the_stream(tmp_path):
    writer = shards.ShardWriter(str(tmp_path), "p", "train", 100)
    stream = np.arange(250)
    for piece in np.split(stream, [30, 31, 190]):  # pieces straddling the shard boundaries
        writer.add(piece)
    paths = writer.close()
    assert [os.path.basename(p) for p in paths] == ["p_train_000000.bin", "p_train_000001.bin", "p_train_000002.bin"]
    assert [shards.read_header(p) for p in paths] == [100, 100, 50]
    assert np.array_equal(np.concatenate([shards.read_shard(p) for p in paths]), stream)


def test_masked_shard_roundtrip_python(tmp_path):
    tokens = np.array([128000, 5, 6, 7, 128009, 9], dtype=np.int64)
    mask = np.array([0, 0, 1, 1, 1, 0])
    path = tmp_path / "m.bin"
    shards.write_shard(path, tokens, mask)
    assert os.path.getsize(path) == 1024 + 5 * len(tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:4]) == [20240801, 7, len(tokens), 1] and not header[4:].any()
    assert np.array_equal(shards.read_shard(path), tokens) and np.array_equal(shards.read_loss_mask(path), mask)
    shards.write_shard(tmp_path / "plain.bin", tokens)
    assert shards.read_loss_mask(tmp_path / "plain.bin") is None
    with pytest.raises(ValueError, match="0 or 1"):
        shards.write_shard(tmp_path / "bad.bin", tokens, [0, 1, 2, 1, 1, 0])
    with pytest.raises(ValueError, match="shape"):
        shards.write_shard(tmp_path / "bad.bin", tokens, [0, 1])
    path.write_bytes(path.read_bytes()[:-1])  # a masked shard missing its last mask byte
    with pytest.raises(ValueError, match="loss mask"):
        shards.read_shard(path)


# ---------------------------------------------------------------------------------------------------------------
# Dataloader


@pytest.mark.parametrize("name", ["roundtrip", "boundary", "shuffle", "resume", "resize", "ranks", "eval"])
def test_dataloader_checks(name, rule_shards):
    result = run_ok([binary("test_dataloader"), "check", name, rule_shards, ",".join(map(str, SIZES))])
    assert "PASSED" in result.stdout and "FAIL:" not in result.stdout


def test_dataloader_past_2gib(tmp_path):
    result = run_ok([binary("test_dataloader"), "bigfile", tmp_path])
    assert "PASSED" in result.stdout


def test_dataloader_matches_python_reader(rule_shards, tmp_path):
    """The C++ batches, shard boundary and epoch wrap included, against what Python reads from the same files."""
    B, T = 2, 3
    per_epoch = sum((n - 1) // (B * T) for n in SIZES)
    result = run_ok(loader_args(rule_shards, B=B, T=T, nbatches=per_epoch + 5))
    batches = parse_batches(result.stdout)
    data = [shards.read_shard(tmp_path / f"data_{s:02d}.bin") for s in range(len(SIZES))]
    expected = [(s, j * B * T) for s, n in enumerate(SIZES) for j in range((n - 1) // (B * T))]
    expected = expected + expected[:5]
    assert [(b[0], b[1]) for b in batches] == expected
    for shard, offset, epoch, inputs, targets in batches:
        window = data[shard][offset : offset + B * T + 1]
        assert inputs == window[:-1].tolist() and targets == window[1:].tolist()
    assert batches[per_epoch - 1][2] == 0 and batches[per_epoch][2] == 1


def test_dataloader_resume_through_a_state_file(rule_shards, tmp_path):
    state = tmp_path / "loader.state"
    full = parse_batches(run_ok(loader_args(rule_shards, shuffle=1, seed=3, nbatches=400) + ["--save-after", 150, state]).stdout)
    resumed = parse_batches(run_ok(loader_args(rule_shards, shuffle=1, seed=3, nbatches=250) + ["--load", state]).stdout)
    assert len(full) == 400 and resumed == full[150:]
    # shuffled at all, so that this compares something a fresh start would get wrong
    fresh = parse_batches(run_ok(loader_args(rule_shards, shuffle=1, seed=3, nbatches=250)).stdout)
    assert fresh != resumed
    # a state cannot be loaded into a loader with another T or shuffle setting (another B carries over: "resize")
    for other in (dict(T=8, shuffle=1), dict(shuffle=0)):
        result = run(loader_args(rule_shards, seed=3, **other) + ["--load", state])
        assert result.returncode != 0 and str(state) in result.stderr and "T=4 shuffle=1" in result.stderr


def test_dataloader_eval_pass_reports_done(rule_shards):
    result = run_ok(loader_args(rule_shards, B=2, T=8, nbatches=0) + ["--eval"])
    expected = sum((n - 1) // 16 for n in SIZES)
    assert len(parse_batches(result.stdout)) == expected
    assert f"eval done after {expected} batches" in result.stdout


def test_dataloader_masked_and_plain_shards(tmp_path):
    """A masked shard delivers -1 for every target whose mask is 0 (inputs untouched); a plain shard next to it
    counts every target. Checked against Python over a whole epoch, shuffled, with two ranks."""
    rng = np.random.default_rng(5)
    sizes = [1000, 777]
    data = [(s + 1) * 1_000_000 + np.arange(n) for s, n in enumerate(sizes)]
    mask = rng.integers(0, 2, size=sizes[0])
    shards.write_shard(tmp_path / "data_00.bin", data[0], mask)
    shards.write_shard(tmp_path / "data_01.bin", data[1])
    masks = [mask, np.ones(sizes[1], dtype=np.int64)]
    B, T = 2, 5
    per_epoch = sum((n - 1) // (2 * B * T) for n in sizes)
    for rank in (0, 1):
        result = run_ok(loader_args(str(tmp_path / "data_*.bin"), B=B, T=T, rank=rank, nproc=2, shuffle=1, seed=9,
                                    nbatches=per_epoch))
        batches = parse_batches(result.stdout)
        assert len(batches) == per_epoch
        masked_seen = 0
        for shard, offset, _, inputs, targets in batches:
            window = data[shard][offset:offset + B * T + 1]
            counts = masks[shard][offset + 1:offset + B * T + 1] == 1
            assert inputs == window[:-1].tolist()
            assert targets == np.where(counts, window[1:], -1).tolist()
            masked_seen += int((~counts).sum())
        assert masked_seen > 0
        counted = [int(l.split(":")[0].split()[9]) for l in result.stdout.splitlines() if l.startswith("batch ")]
        assert counted == [sum(t >= 0 for t in b[4]) for b in batches]


def make_bad_shard(tmp_path, case):
    """Writes a broken shard into tmp_path; returns (pattern, loader kwargs, words the error must contain)."""
    path = tmp_path / "bad_000.bin"
    good = np.arange(200)
    if case == "wrong_magic":
        path.write_bytes(shards.make_header(200, magic=20240520).tobytes() + good.astype("<u4").tobytes())
        return str(path), {}, ["magic 20240520"]
    if case == "wrong_version":
        path.write_bytes(shards.make_header(200, version=1).tobytes() + good.astype("<u4").tobytes())
        return str(path), {}, ["version 1"]
    if case == "truncated":
        shards.write_shard(path, good)
        path.write_bytes(path.read_bytes()[:-6])
        return str(path), {}, ["truncated"]
    if case == "trailing_bytes":
        shards.write_shard(path, good)
        path.write_bytes(path.read_bytes() + b"\0" * 4)
        return str(path), {}, ["bytes"]
    if case == "shorter_than_header":
        path.write_bytes(b"\0" * 100)
        return str(path), {}, ["header"]
    if case == "empty_pattern":
        return str(tmp_path / "nothing_here_*.bin"), {}, ["no files match"]
    if case == "too_small":
        shards.write_shard(tmp_path / "ok_000.bin", good)  # one good shard does not excuse a small one
        shards.write_shard(path, np.arange(16))  # B*T+1 = 17 tokens are needed
        return str(tmp_path / "*.bin"), {"B": 2, "T": 8}, ["16 tokens", "17"]
    if case in ("token_out_of_vocab", "target_out_of_vocab"):
        tokens = np.arange(200) % 100
        # 37 is in the third batch (tokens 32..48); 16 = B*T is only the first batch's last target
        where = 37 if case == "token_out_of_vocab" else 16
        tokens[where] = 4096
        shards.write_shard(path, tokens)
        return str(path), {"B": 2, "T": 8, "vocab": 4096}, [f"token offset {where}", "4096"]
    if case == "mask_flag_2":
        header = shards.make_header(200)
        header[3] = 2
        path.write_bytes(header.tobytes() + good.astype("<u4").tobytes())
        return str(path), {}, ["loss-mask flag 2"]
    if case == "mask_missing":  # flagged as masked, but only the tokens are there
        path.write_bytes(shards.make_header(200, masked=True).tobytes() + good.astype("<u4").tobytes())
        return str(path), {}, ["loss mask", "truncated"]
    if case == "mask_byte_not_01":
        mask = np.ones(200, dtype=np.uint8)
        shards.write_shard(path, good, mask)
        data = bytearray(path.read_bytes())
        data[1024 + 4 * 200 + 40] = 7  # in the third batch (tokens 32..48)
        path.write_bytes(bytes(data))
        return str(path), {"B": 2, "T": 8}, ["loss-mask byte 7", "token offset 40"]
    raise ValueError(case)


BAD_CASES = ["wrong_magic", "wrong_version", "truncated", "trailing_bytes", "shorter_than_header", "empty_pattern",
             "too_small", "token_out_of_vocab", "target_out_of_vocab", "mask_flag_2", "mask_missing",
             "mask_byte_not_01"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_dataloader_rejects_bad_input(tmp_path, case):
    pattern, kwargs, words = make_bad_shard(tmp_path, case)
    result = run(loader_args(pattern, nbatches=20, **kwargs))
    assert result.returncode != 0, f"{case}: exited 0\n{result.stdout}"
    named = pattern if case == "empty_pattern" else str(tmp_path / "bad_000.bin")
    assert named in result.stderr, f"{case}: the message does not name {named}: {result.stderr}"
    for word in words:
        assert word in result.stderr, f"{case}: '{word}' missing from: {result.stderr}"
    # the batches before the damage may pass, the one that holds it must not
    batches_before = 40 // 16 if case == "mask_byte_not_01" else 37 // 16 if case == "token_out_of_vocab" else 0
    assert len(parse_batches(result.stdout)) == batches_before, f"{case}: a bad batch got through\n{result.stdout}"


def test_dataloader_good_shard_passes_the_same_run(tmp_path):
    """The bad-input runs fail because of the damage alone: the same run over a good shard succeeds."""
    shards.write_shard(tmp_path / "good_000.bin", np.arange(200) % 100)
    result = run_ok(loader_args(str(tmp_path / "good_000.bin"), B=2, T=8, vocab=4096, nbatches=20))
    assert len(parse_batches(result.stdout)) == 20


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer and tiny shakespeare (need the real files)


SHIPPED = {"LLAMA3_TOKENIZER": DATA_SCRIPTS / "llama3" / "tokenizer.model",
           "TINYSHAKESPEARE_TXT": DATA_SCRIPTS / "tinyshakespeare.txt"}


def env_path(name):
    """The file the environment variable `name` names, else the repo's copy."""
    path = os.environ.get(name) or str(SHIPPED[name])
    if not os.path.isfile(path):
        pytest.fail(f"{name}={path} does not exist")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from llama3_tokenizer import Llama3Tokenizer

    return Llama3Tokenizer(env_path("LLAMA3_TOKENIZER"))


@pytest.fixture(scope="module")
def tokenizer_bin(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("tokenizer") / "tokenizer.bin"
    run_ok([sys.executable, DATA_SCRIPTS / "export_tokenizer.py", "--tokenizer", env_path("LLAMA3_TOKENIZER"),
            "--out", out])
    return out


@pytest.fixture(scope="module")
def tinyshakespeare(tmp_path_factory):
    """Runs dev/data/tinyshakespeare.py once; the tokens are shared by the tests below."""
    out_dir = tmp_path_factory.mktemp("tinyshakespeare")
    env = dict(os.environ, LLAMA3_TOKENIZER=env_path("LLAMA3_TOKENIZER"), TINYSHAKESPEARE_TXT=env_path("TINYSHAKESPEARE_TXT"))
    result = subprocess.run([sys.executable, DATA_SCRIPTS / "tinyshakespeare.py", "--out_dir", out_dir],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    val = shards.read_shard(out_dir / "tiny_shakespeare_val.bin")
    train = shards.read_shard(out_dir / "tiny_shakespeare_train.bin")
    return {"stdout": result.stdout, "val": val, "train": train, "dir": out_dir}


def test_tinyshakespeare_token_counts(tinyshakespeare, tokenizer):
    val, train = tinyshakespeare["val"], tinyshakespeare["train"]
    print(tinyshakespeare["stdout"])
    assert (len(train), len(val)) == (TINYSHAKESPEARE_TRAIN_TOKENS, TINYSHAKESPEARE_VAL_TOKENS)
    assert len(train) + len(val) == 308992
    stream = np.concatenate([val, train])
    bos = stream == tokenizer.bos_id
    assert bos.sum() == TINYSHAKESPEARE_DOCS and val[0] == tokenizer.bos_id and train[0] == tokenizer.bos_id
    # with the BOS ids taken out, the tokens decode back to the corpus, byte for byte
    text = Path(env_path("TINYSHAKESPEARE_TXT")).read_bytes()
    assert tokenizer.decode_bytes(stream[~bos].tolist()) == text


def test_tinyshakespeare_shards_load_in_cpp(tinyshakespeare):
    pattern = str(tinyshakespeare["dir"] / "tiny_shakespeare_*.bin")
    result = run_ok(loader_args(pattern, B=4, T=64, vocab=128256, nbatches=3))
    assert parse_batches(result.stdout)[0][3][0] == 128000  # the first token of the val shard is BOS


def test_python_tokenizer(tokenizer):
    specials = tokenizer.special_tokens
    assert len(specials) == 256 and tokenizer.n_words == 128256
    assert specials["<|begin_of_text|>"] == 128000 and specials["<|end_of_text|>"] == 128001
    assert specials["<|reserved_special_token_0|>"] == 128002 and specials["<|start_header_id|>"] == 128006
    assert specials["<|end_header_id|>"] == 128007 and specials["<|eot_id|>"] == 128009
    assert specials["<|reserved_special_token_250|>"] == 128255
    assert tokenizer.encode("Hello world", bos=True, eos=True) == [128000, 9906, 1917, 128001]
    assert 128009 not in tokenizer.encode("<|eot_id|>")  # special-token text in data stays text
    text = "naïve café — 日本語 🚀\n\n  x"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    long_text = "ab " * 200_000 + " " * 60_000 + "z" * 60_000  # goes through the long-text split
    assert tokenizer.decode(tokenizer.encode(long_text)) == long_text


def test_cpp_decoder_matches_tiktoken(tinyshakespeare, tokenizer, tokenizer_bin, tmp_path):
    unicode_text = "naïve café — 日本語のテキスト 🚀🦙 Ελληνικά Привет\n"
    ids = np.concatenate([tinyshakespeare["val"], tinyshakespeare["train"], tokenizer.encode(unicode_text),
                          np.arange(128000, 128256)]).astype("<u4")
    ids_path, expected_path = tmp_path / "ids.bin", tmp_path / "expected.bin"
    ids.tofile(ids_path)
    expected_path.write_bytes(tokenizer.decode_bytes(ids.tolist()))
    result = run_ok([binary("test_tokenizer"), tokenizer_bin, ids_path, expected_path])
    assert "PASSED" in result.stdout and "FAIL:" not in result.stdout
    assert f"decoding {len(ids)} ids gives tiktoken's" in result.stdout


def test_cpp_sample_printing(tokenizer, tokenizer_bin):
    ids = tokenizer.encode("Thou art 日本 \x1b[2J") + [128009, 128256]
    result = run_ok([binary("test_tokenizer"), "--print", tokenizer_bin] + ids)
    assert result.stdout == "Thou art 日本 \ufffd[2J<|eot_id|><|bad id 128256|>\n"


@pytest.mark.parametrize("case", ["wrong_magic", "wrong_version", "truncated", "trailing_bytes"])
def test_cpp_tokenizer_rejects_bad_file(tokenizer_bin, tmp_path, case):
    data = bytearray(tokenizer_bin.read_bytes())
    if case == "wrong_magic":
        data[0:4] = (12345).to_bytes(4, "little")
    elif case == "wrong_version":
        data[4:8] = (2).to_bytes(4, "little")
    elif case == "truncated":
        data = data[:-10]
    else:
        data += b"\0"
    path = tmp_path / "broken_tokenizer.bin"
    path.write_bytes(bytes(data))
    result = run([binary("test_tokenizer"), "--load", path])
    assert result.returncode != 0 and str(path) in result.stderr, result.stderr
    run_ok([binary("test_tokenizer"), "--load", tokenizer_bin])


# ---------------------------------------------------------------------------------------------------------------
# text_to_shards.py


def text_to_shards(args):
    env = dict(os.environ, LLAMA3_TOKENIZER=env_path("LLAMA3_TOKENIZER"))
    result = subprocess.run([sys.executable, DATA_SCRIPTS / "text_to_shards.py"] + [str(a) for a in args],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return result


def read_split(out_dir, prefix, split):
    paths = sorted(Path(out_dir).glob(f"{prefix}_{split}_*.bin"))
    return paths, (np.concatenate([shards.read_shard(p) for p in paths]) if paths else np.zeros(0, np.uint32))


def test_text_to_shards_jsonl_first_shard_val(tokenizer, tmp_path):
    docs = [f"Document {i}: " + "words and more words. " * (i % 7 + 1) + "ünïcödé" for i in range(300)]
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    out = tmp_path / "out"
    text_to_shards(["--input", src, "--out_dir", out, "--text_key", "body", "--shard_size", 1000, "--workers", 2])
    expected = np.array([t for d in docs for t in tokenizer.encode(d, bos=True)], dtype=np.uint32)
    val_paths, val = read_split(out, "corpus", "val")
    train_paths, train = read_split(out, "corpus", "train")
    assert [p.name for p in val_paths] == ["corpus_val_000000.bin"]
    assert train_paths[0].name == "corpus_train_000000.bin" and len(train_paths) == -(-(len(expected) - 1000) // 1000)
    assert len(val) == 1000 and np.array_equal(np.concatenate([val, train]), expected)


def test_text_to_shards_directory_val_fraction(tokenizer, tmp_path):
    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("First para.\n\nSecond para\nwith two lines.\n\n\nThird.", encoding="utf-8")
    (src / "sub" / "b.jsonl").write_text(json.dumps({"text": "from json"}) + "\n", encoding="utf-8")
    (src / "ignored.md").write_text("not read", encoding="utf-8")
    docs = ["First para.\n\n", "Second para\nwith two lines.\n\n", "\nThird.", "from json"]
    out = tmp_path / "out"
    text_to_shards(["--input", src, "--out_dir", out, "--prefix", "mix", "--val_fraction", 0.5, "--seed", 1,
                    "--workers", 1])
    _, val = read_split(out, "mix", "val")
    _, train = read_split(out, "mix", "train")
    encoded = [tokenizer.encode(d, bos=True) for d in docs]
    # every document lands whole in exactly one split, in input order within it
    val_docs = [d for d in encoded if _contains(val, d)]
    train_docs = [d for d in encoded if _contains(train, d)]
    assert len(val_docs) + len(train_docs) == len(docs) and len(val) + len(train) == sum(map(len, encoded))
    assert 0 < len(val_docs) < len(docs)  # with this seed both splits get some


def test_text_paragraphs_stream_like_a_whole_file_split(tmp_path, monkeypatch):
    """Reading in tiny chunks cuts the same paragraphs as tinyshakespeare.py's split of the whole text."""
    import text_to_shards as tts
    from tinyshakespeare import split_documents

    text = "a\n\nbb\n\n\ncc\n\n\n\nd\ne\n\n" + "long paragraph " * 20 + "\n\n\n\n\nend\n"
    path = tmp_path / "t.txt"
    for text in (text, text + "\n", "\n\nstarts blank", "x"):
        path.write_text(text, encoding="utf-8")
        for chunk in (1, 2, 3, 7, 1000):
            monkeypatch.setattr(tts, "READ_CHUNK_CHARS", chunk)
            docs = list(tts.paragraph_documents(str(path)))
            assert docs == split_documents(text) and "".join(docs) == text, (text, chunk)


def _contains(stream, doc):
    n = len(doc)
    return any(np.array_equal(stream[i : i + n], doc) for i in range(len(stream) - n + 1))


# ---------------------------------------------------------------------------------------------------------------
# debian_docs.py, over a small tree laid out as the Debian packages install theirs (symlinks included)

DEBIAN_ORDER = ["linux-doc", "python3-doc", "perl-doc"]  # the order the script reads the packages in


def write_text(path, text, compress=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8")
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)


def make_debian_tree(root, packages=DEBIAN_ORDER):
    """Writes the packages' files under root; returns {document name: text} of what the script should read."""
    texts = {}
    doc = root / "usr/share/doc"

    def add(name, path, compress=False):
        text = f"{name}\n{'=' * len(name)}\n\n" + "The naïve café's driver — 日本語 ok.\n" * (len(texts) % 11 + 1)
        write_text(path, text, compress)
        texts[name] = text

    if "linux-doc" in packages:
        docs = doc / "linux-doc-6.1/Documentation"
        for i in range(30):
            ending = ".rst" if i % 3 else ".txt"
            add(f"linux-doc/area{i % 4}/doc{i}{ending}", docs / f"area{i % 4}/doc{i}{ending}{'.gz' * (i % 2)}", i % 2)
        write_text(docs / "translations/it_IT/doc0.rst", "Documentazione tradotta.\n")
        write_text(docs / "area0/bindings.yaml.gz", "compatible: x\n", compress=True)
        write_text(docs / "images/logo.svg", "<svg/>\n")
        (doc / "linux-doc").symlink_to("linux-doc-6.1")
    if "python3-doc" in packages:
        sources = doc / "python3.11/html/_sources"
        for i in range(8):
            add(f"python3-doc/library/mod{i}.rst.txt", sources / f"library/mod{i}.rst.txt")
        (doc / "python3-doc").mkdir(parents=True)
        (doc / "python3-doc/html").symlink_to("../python3.11/html")
    pod = root / "usr/share/perl/5.36.0/pod"
    write_text(pod / "perldiag.pod", "=head1 NAME\n\nperldiag\n")  # perl-modules ships it, with or without perl-doc
    if "perl-doc" in packages:
        texts["perl-doc/perldiag.pod"] = "=head1 NAME\n\nperldiag\n"
        for i in range(5):
            add(f"perl-doc/perlpage{i}.pod", pod / f"perlpage{i}.pod")
        write_text(pod / "perltoc.pod", "=head1 NAME\n\nperltoc - table of contents\n")
        write_text(pod / "perljp.pod", "=head1 NAME\n\nperljp - 日本語\n")
        (doc / "perl-doc").mkdir(parents=True)
    (root / "usr/share/perl/5.36").symlink_to("5.36.0")
    return texts


def debian_docs(args):
    env = dict(os.environ, LLAMA3_TOKENIZER=env_path("LLAMA3_TOKENIZER"))
    return subprocess.run([sys.executable, DATA_SCRIPTS / "debian_docs.py"] + [str(a) for a in args],
                          capture_output=True, text=True, env=env)


def debian_docs_ok(args):
    result = debian_docs(args)
    assert result.returncode == 0, result.stderr
    return result


def split_at_bos(stream, tokenizer):
    """The texts of the documents of a token stream, each starting at a <|begin_of_text|>."""
    starts = np.flatnonzero(stream == tokenizer.bos_id).tolist()
    assert starts[:1] == [0]
    return [tokenizer.decode_bytes(stream[a + 1 : b].tolist()).decode("utf-8")
            for a, b in zip(starts, starts[1:] + [len(stream)])]


def test_debian_docs_shards_decode_to_the_documents(tmp_path, tokenizer):
    root, out = tmp_path / "root", tmp_path / "out"
    texts = make_debian_tree(root)
    val_tokens = 300
    result = debian_docs_ok(["--root", root, "--out_dir", out, "--val_tokens", val_tokens, "--shard_tokens", 1000,
                             "--workers", 2])
    name_of = {text: name for name, text in texts.items()}
    val_paths, val = read_split(out, "debian_docs", "val")
    train_paths, train = read_split(out, "debian_docs", "train")
    val_names = [name_of[t] for t in split_at_bos(val, tokenizer)]
    train_names = [name_of[t] for t in split_at_bos(train, tokenizer)]
    # every document once (the left-out files not at all), both splits in SHA-256 order of the names: the packages
    # interleaved
    by_hash = sorted(texts, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    assert sorted(val_names + train_names) == sorted(texts)
    assert val_names + train_names == by_hash
    assert len({n.split("/")[0] for n in train_names[:len(train_names) // 2]}) == 3
    # validation: the fewest documents, first in SHA-256 order of their names, that reach val_tokens
    sizes = [len(tokenizer.encode(texts[n], bos=True)) for n in by_hash]
    take = next(k for k in range(1, len(sizes) + 1) if sum(sizes[:k]) >= val_tokens)
    assert sorted(val_names) == sorted(by_hash[:take]) and 0 < len(val_names) < len(texts)
    assert len(val) == sum(sizes[:take]) >= val_tokens
    # shards of --shard_tokens tokens, the last one shorter
    assert [p.name for p in val_paths] == ["debian_docs_val_000000.bin"]
    assert [shards.read_header(p) for p in train_paths[:-1]] == [1000] * (len(train_paths) - 1)
    assert len(train_paths) == -(-len(train) // 1000) >= 2
    assert f"val:   {len(val)} tokens ({take} documents)" in result.stdout
    assert "linux-doc: 30 documents" in result.stdout and "perl-doc: 6 documents" in result.stdout


def test_debian_docs_output_independent_of_workers_and_root(tmp_path):
    root = tmp_path / "root"
    make_debian_tree(root)
    shutil.copytree(root, tmp_path / "elsewhere", symlinks=True)
    outs = {"one": tmp_path / "one", "two": tmp_path / "two", "moved": tmp_path / "moved"}
    outs["two"].mkdir()
    (outs["two"] / "debian_docs_train_000042.bin").write_bytes(b"left by an earlier run")
    debian_docs_ok(["--root", root, "--out_dir", outs["one"], "--val_tokens", 200, "--shard_tokens", 700,
                    "--workers", 1])
    debian_docs_ok(["--root", root, "--out_dir", outs["two"], "--val_tokens", 200, "--shard_tokens", 700,
                    "--workers", 2])
    debian_docs_ok(["--root", tmp_path / "elsewhere", "--out_dir", outs["moved"], "--val_tokens", 200,
                    "--shard_tokens", 700])
    files = {key: {p.name: p.read_bytes() for p in sorted(out.iterdir())} for key, out in outs.items()}
    assert len(files["one"]) >= 3 and "debian_docs_val_000000.bin" in files["one"]
    assert files["one"] == files["two"] == files["moved"]


def test_debian_docs_missing_package(tmp_path):
    root = tmp_path / "root"
    make_debian_tree(root, packages=["linux-doc"])  # perl's perldiag.pod is there, perl-doc is not
    result = debian_docs(["--root", root, "--out_dir", tmp_path / "out"])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "python3-doc, perl-doc are not installed" in result.stderr
    assert "sudo apt-get install python3-doc perl-doc\n" in result.stderr
    assert not (tmp_path / "out").exists()
    result = debian_docs(["--root", tmp_path / "empty", "--out_dir", tmp_path / "out", "--packages", "perl-doc"])
    assert result.returncode != 0 and "sudo apt-get install perl-doc\n" in result.stderr
    # the packages that are there are enough when only they are asked for
    result = debian_docs_ok(["--root", root, "--out_dir", tmp_path / "out", "--packages", "linux-doc",
                             "--val_tokens", 0])
    assert "30 documents" in result.stdout and "val:   0 tokens (0 documents) in 0 shard(s)" in result.stdout
