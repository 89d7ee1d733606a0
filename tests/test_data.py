"""research/data.py: every --data kind, tokenizers, the token cache, packing, the global
batch order, DP micro-batches, and the distributed build (2 gloo ranks)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from research import data as D
from tests.dist_utils import run_distributed

DOCS = ["alpha beta gamma\n", "naïve café — ünïcode ✓", "", "last line\nwith two lines"]
BYTE = D.ByteTokenizer()


def _stream(texts: list[str], tok: D.Tokenizer = BYTE) -> list[int]:
    eos = [] if tok.eos_id is None else [tok.eos_id]
    return [i for t in texts for i in tok.encode(t) + eos]


def _jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    lines = "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts))
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def _load(data, tmp_path: Path, tok: D.Tokenizer = BYTE, **kw) -> list[int]:
    tokens = D.load_tokens(None if data is None else str(data), tok, cache_dir=tmp_path / "cache", **kw)
    assert isinstance(tokens, np.memmap) and not tokens.flags.writeable
    return tokens.tolist()


# --- tokenizers --------------------------------------------------------------------------


def test_byte_tokenizer_round_trip() -> None:
    tok = D.load_tokenizer(None)
    assert isinstance(tok, D.ByteTokenizer) and isinstance(D.load_tokenizer("byte"), D.ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    for text in DOCS:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    assert tok.decode([*tok.encode("x"), 256, *tok.encode("y")]) == "xy"  # EOS decodes to nothing


def test_missing_tokenizer_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--tokenizer .*nope"):
        D.load_tokenizer(str(tmp_path / "nope" / "tokenizer.json"))


def _word_level(path: Path, special: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=special)
    tok.train_from_iterator(["the cat sat", "the dog ran", "a cat ran"], trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_end_to_end(tmp_path: Path) -> None:
    tok = D.load_tokenizer(str(_word_level(tmp_path / "tokenizer.json", ["[UNK]", "<|endoftext|>"])))
    assert isinstance(tok, D.HFTokenizer)
    assert tok.vocab_size == 2 + len({"the", "cat", "sat", "dog", "ran", "a"})
    assert tok.eos_id == 1
    texts = ["the cat sat", "a dog ran the cat", "zebra"]
    assert tok.decode(tok.encode(texts[1])) == texts[1]
    data = _jsonl(tmp_path / "d.jsonl", texts)
    tokens = _load(data, tmp_path, tok)
    assert tokens == _stream(texts, tok) and tokens.count(1) == 3 and tokens[-2] == 0  # "zebra" -> [UNK]
    # The same stream with 2 map processes; a different tokenizer file is another cache entry.
    assert D.load_tokens(str(data), tok, cache_dir=tmp_path / "cache2", num_proc=2).tolist() == tokens
    no_eos = D.load_tokenizer(str(_word_level(tmp_path / "plain.json", ["[UNK]"])))
    assert no_eos.eos_id is None
    assert _load(data, tmp_path, no_eos) == _stream(texts, no_eos)
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 2


# --- --data kinds -------------------------------------------------------------------------


def test_txt_folder_recursive_sorted(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    for name, text in [
        ("b.txt", DOCS[1]),
        ("sub/c.txt", DOCS[3]),
        ("a.txt", DOCS[0]),
        (".hidden/z.txt", "no"),
        ("notes.md", "no"),
    ]:
        (root / name).write_text(text, encoding="utf-8")
    assert _load(root, tmp_path) == _stream([DOCS[0], DOCS[1], DOCS[3]])  # one document per file


def test_glob(tmp_path: Path) -> None:
    for i, text in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(text, encoding="utf-8")
    _jsonl(tmp_path / "x.jsonl", ["not matched"])
    assert _load(tmp_path / "*.txt", tmp_path) == _stream(DOCS)


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.json"])
def test_jsonl_with_text_field(tmp_path: Path, name: str) -> None:
    data = _jsonl(tmp_path / name, DOCS, field="content")
    tokens = D.load_tokens(str(data), BYTE, text_field="content", cache_dir=tmp_path / "cache")
    assert tokens.tolist() == _stream(DOCS)
    with pytest.raises(ValueError, match="no --text-field 'text'"):
        D.load_tokens(str(data), BYTE, cache_dir=tmp_path / "cache")


def test_parquet_and_mixed_folder_in_path_order(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    pq.write_table(pa.table({"text": pa.array(DOCS[:2], pa.large_string()), "n": [1, 2]}), root / "a.parquet")
    assert _load(root / "a.parquet", tmp_path) == _stream(DOCS[:2])
    _jsonl(root / "b.jsonl.gz", [DOCS[2]])
    (root / "c.txt").write_text(DOCS[3], encoding="utf-8")
    _jsonl(root / "d.jsonl", ["tail"])
    assert _load(root, tmp_path) == _stream([*DOCS, "tail"])


def test_save_to_disk(tmp_path: Path) -> None:
    ds = datasets.Dataset.from_dict({"body": DOCS, "n": list(range(len(DOCS)))})
    ds.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"test": ds.select([0]), "train": ds.select([3, 1])}).save_to_disk(str(tmp_path / "dd"))
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "no_train"))
    tokens = D.load_tokens(str(tmp_path / "ds"), BYTE, text_field="body", cache_dir=tmp_path / "cache")
    assert tokens.tolist() == _stream(DOCS)
    tokens = D.load_tokens(str(tmp_path / "dd"), BYTE, text_field="body", cache_dir=tmp_path / "cache")
    assert tokens.tolist() == _stream([DOCS[3], DOCS[1]])
    with pytest.raises(ValueError, match="without a 'train' split"):
        D.load_tokens(str(tmp_path / "no_train"), BYTE, text_field="body", cache_dir=tmp_path / "cache")


def test_embedded_default_corpus(tmp_path: Path) -> None:
    assert D.CORPUS.stat().st_size < 600_000
    assert (D.CORPUS.parent / "LICENSE").is_file() and (D.CORPUS.parent / "PROVENANCE.md").is_file()
    with gzip.open(D.CORPUS, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    sources = [r["source"] for r in rows]
    assert len(rows) >= 40 and sources == sorted(sources) and all(s.startswith("Lib/") for s in sources)
    tokens = D.load_tokens(None, BYTE, cache_dir=tmp_path / "cache")
    assert len(tokens) == sum(len(r["text"].encode()) + 1 for r in rows) > 1_000_000
    first = len(rows[0]["text"].encode())
    assert BYTE.decode(tokens[:first]) == rows[0]["text"] and tokens[first] == BYTE.eos_id


@pytest.mark.parametrize("data", ["./nope", "/no/such/dir", "missing.jsonl", "a/b/c", "~/no-such-zero3d-data"])
def test_missing_local_path(tmp_path: Path, data: str) -> None:
    with pytest.raises(ValueError, match=rf"^--data path '{data}' does not exist\.$"):
        D.load_tokens(data, BYTE, cache_dir=tmp_path / "cache")


def test_empty_glob_and_folder(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"--data glob .* matches no"):
        D.load_tokens(str(tmp_path / "*.jsonl"), BYTE, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"--data folder .* holds no"):
        D.load_tokens(str(tmp_path), BYTE, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"--data file .* is not"):
        D.load_tokens(str(tmp_path / "x.csv"), BYTE, cache_dir=tmp_path / "cache")


def test_hub_name_offline_or_failing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"--data 'someorg/somedata' .*while it is offline"):
        D.load_tokens("someorg/somedata", BYTE, cache_dir=tmp_path / "cache")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")

    def unreachable(*args, **kwargs):
        raise ConnectionError("no route to the hub")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(ValueError, match=r"--data 'somedata' .*ConnectionError: no route to the hub"):
        D.load_tokens("somedata", BYTE, cache_dir=tmp_path / "cache")


# --- the cache ----------------------------------------------------------------------------


def test_cache_is_reused_and_keyed_on_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _jsonl(tmp_path / "d.jsonl", DOCS)
    first = D.load_tokens(str(data), BYTE, cache_dir=tmp_path / "cache")
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 2 and files[0].endswith(".json") and files[1].endswith(".npy")  # no scratch left
    npy = tmp_path / "cache" / files[1]
    meta = json.loads(npy.with_suffix(".json").read_text())
    assert (meta["tokens"], meta["documents"], meta["dtype"]) == (len(first), len(DOCS), "uint16")
    stat = npy.stat()

    def no_map(*args, **kwargs):
        raise AssertionError("re-tokenized although the cache holds this stream")

    monkeypatch.setattr(datasets.Dataset, "map", no_map)
    again = D.load_tokens(str(data), BYTE, cache_dir=tmp_path / "cache")
    assert again.filename == first.filename and np.array_equal(again, first)
    assert (npy.stat().st_mtime_ns, npy.stat().st_ino) == (stat.st_mtime_ns, stat.st_ino)
    _jsonl(data, DOCS[:1])  # the file changed: a new key, so a new tokenization
    with pytest.raises(AssertionError, match="re-tokenized"):
        D.load_tokens(str(data), BYTE, cache_dir=tmp_path / "cache")


# --- packing and batch order --------------------------------------------------------------


def test_packing_labels_are_inputs_shifted() -> None:
    tokens = np.arange(100, 141, dtype=np.uint16)  # 41 tokens, L = 8: S = 40 // 8 = 5 sequences
    batches = D.GlobalBatches(tokens, seq_len=8, global_batch_size=5, seed=0)
    assert batches.n_sequences == 5
    inputs, labels = batches.batch(0)
    assert inputs.shape == labels.shape == (5, 8) and inputs.dtype == labels.dtype == torch.int64
    for x, y in zip(inputs, labels):
        k = (int(x[0]) - 100) // 8
        assert torch.equal(x, torch.arange(100 + 8 * k, 108 + 8 * k)) and torch.equal(y, x + 1)
    assert sorted(int(x[0]) for x in inputs) == [100, 108, 116, 124, 132]  # an epoch sees each once


def test_too_little_data() -> None:
    with pytest.raises(D.DataError, match="the data has 8 tokens, but one sequence of --seq-len=8 needs 9"):
        D.GlobalBatches(np.zeros(8, np.uint16), seq_len=8, global_batch_size=1, seed=0)


def _cat(batches: D.GlobalBatches, steps: range) -> torch.Tensor:
    return torch.cat([batches.batch(s)[0] for s in steps])


def test_batch_order_depends_only_on_seed() -> None:
    tokens = np.arange(1 + 4 * 37, dtype=np.uint16)  # S = 37 sequences of 4
    eight = D.GlobalBatches(tokens, 4, 8, seed=7)
    assert torch.equal(_cat(eight, range(12)), _cat(D.GlobalBatches(tokens, 4, 8, seed=7), range(12)))
    assert torch.equal(_cat(eight, range(12)), _cat(D.GlobalBatches(tokens, 4, 4, seed=7), range(24)))
    assert not torch.equal(_cat(eight, range(12)), _cat(D.GlobalBatches(tokens, 4, 8, seed=8), range(12)))
    # A pure function of step: a resumed run (fresh object, any call order) gets the same batches.
    resumed = D.GlobalBatches(tokens, 4, 8, seed=7)
    for step in (11, 3, 9, 0):
        assert all(torch.equal(a, b) for a, b in zip(resumed.batch(step), eight.batch(step)))


def test_epoch_wrap() -> None:
    tokens = np.arange(1 + 3 * 10, dtype=np.uint16)  # S = 10 sequences of 3; B = 4 crosses epoch ends
    batches = D.GlobalBatches(tokens, 3, 4, seed=1)
    firsts = (_cat(batches, range(10))[:, 0] // 3).tolist()  # 40 positions = 4 epochs
    epochs = [firsts[10 * e : 10 * e + 10] for e in range(4)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs == [batches.permutation(e).tolist() for e in range(4)] and len({tuple(e) for e in epochs}) > 1
    assert batches.epoch(5) == 2.0


def test_local_micro_batches_are_slices_of_the_one_process_micro_batches() -> None:
    inputs, labels = D.GlobalBatches(np.arange(200, dtype=np.uint16), 5, 12, seed=0).batch(2)
    dp, m = 2, 3
    parts = [D.local_micro_batches(inputs, labels, d, dp, m) for d in range(dp)]
    assert all(len(p) == m and all(x.shape == y.shape == (2, 5) for x, y in p) for p in parts)
    # micro-batch j of every rank together: rows [4j, 4j + 4), the one-process micro-batch j
    assert torch.equal(torch.cat([parts[d][j][0] for j in range(m) for d in range(dp)]), inputs)
    assert torch.equal(torch.cat([parts[d][j][1] for j in range(m) for d in range(dp)]), labels)
    assert torch.equal(parts[1][0][0], inputs[2:4])
    with pytest.raises(ValueError, match="global_batch_size=12 is not divisible by dp=5"):
        D.local_micro_batches(inputs, labels, 0, 5, 1)
    with pytest.raises(ValueError, match="micro_batches=4"):
        D.local_micro_batches(inputs, labels, 0, 2, 4)
    with pytest.raises(ValueError, match="dp_rank=2"):
        D.local_micro_batches(inputs, labels, 2, 2, 1)


# --- distributed --------------------------------------------------------------------------


def _rank_loads(data: str, runs: list[tuple[str, str]]) -> list[tuple[int, list[int] | str]]:
    """For each (cache_dir, text_field): (how often this rank tokenized, its tokens or error)."""
    build, out = D._build, []

    def counting(*args, **kwargs):
        out[-1][0] += 1
        return build(*args, **kwargs)

    D._build = counting
    for cache_dir, text_field in runs:
        out.append([0, None])
        try:
            out[-1][1] = D.load_tokens(data, BYTE, text_field=text_field, cache_dir=cache_dir).tolist()
        except ValueError as e:
            dist.barrier()  # both ranks got here: nobody hung
            out[-1][1] = f"{type(e).__name__}: {e}"
    D._build = build
    return [tuple(o) for o in out]


def test_distributed_rank0_builds_once(tmp_path: Path) -> None:
    data, cache, bad = str(_jsonl(tmp_path / "d.jsonl", DOCS)), tmp_path / "cache", tmp_path / "bad"
    runs = [(str(cache), "text"), (str(cache), "text"), (str(bad), "body")]
    rank0, rank1 = run_distributed(_rank_loads, 2, data, runs, timeout=120)
    # Rank 0 tokenizes once; rank 1 waits and maps the same file; a second call rebuilds nothing.
    assert [b for b, _ in rank0] == [1, 0, 1] and [b for b, _ in rank1] == [0, 0, 0]
    assert rank0[0][1] == rank1[0][1] == rank0[1][1] == rank1[1][1] == _stream(DOCS)
    assert len(list(cache.glob("*.npy"))) == 1
    # Rank 0 fails to build: both ranks raise its DataError, and neither hangs.
    assert rank0[2][1].startswith("DataError") and "no --text-field 'body'" in rank0[2][1]
    assert rank1[2][1] == rank0[2][1]
    assert os.listdir(bad) == []
