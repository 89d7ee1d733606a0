"""Training data: HF ``datasets`` in, a cached flat token stream, fixed-length packed
sequences, and one global-batch order shared by every (tp, pp, dp) layout.

    --data -> Dataset with a "text" column                          load_text_dataset
           -> Dataset.map(batched): doc_i -> ids_i + [eos]          (inside load_tokens)
           -> flat stream t_0 .. t_{N-1}: <cache>/tokens-<key>.npy + .json, built once
              (by global rank 0), memory-mapped by every rank       load_tokens
    sequence k = t[k*L : k*L + L + 1]; inputs = [:-1], labels = [1:]          GlobalBatches
    global batch s = sequences at positions [s*B, (s+1)*B) of perm_0 ‖ perm_1 ‖ ...
    dp rank d: rows [d*B/dp, (d+1)*B/dp), cut into m micro-batches    local_micro_batches

The cache key hashes the data source (file paths, sizes, mtimes; a saved dataset's
fingerprint; a hub name), the tokenizer (a hash of its file) and the text field, not
seq_len: packing slices the same stream for any length.
"""
from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    import datasets

CORPUS = Path(__file__).with_name("corpus") / "stdlib.jsonl.gz"  # the default --data (see corpus/PROVENANCE.md)
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # suffix -> datasets builder
_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
_CACHE_VERSION = 1


class Tokenizer(Protocol):
    """What the pipeline needs of a tokenizer (ByteTokenizer, HFTokenizer)."""

    vocab_size: int
    eos_id: int | None  # appended after every document when not None
    identity: str  # what the cache key hashes

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and EOS = 256 (vocab_size 257): decode(encode(s)) == s."""

    vocab_size, eos_id, identity = 257, 256, "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` file (tokenizer.json). vocab_size counts added tokens; EOS is the first
    of <|endoftext|>, </s>, <eos>, [SEP] in the vocabulary, else None. Encoding adds no
    special tokens of the file's post-processor (the EOS after each document is ours)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.path = Path(path)
        self._tok = _Tokenizer.from_file(str(self.path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = next((i for t in _EOS_TOKENS if (i := self._tok.token_to_id(t)) is not None), None)
        self.identity = "tokenizers:" + hashlib.sha256(self.path.read_bytes()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str | None) -> Tokenizer:
    """None or "byte": ByteTokenizer; otherwise the path of a ``tokenizers`` JSON file."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"--tokenizer {spec!r} is neither 'byte' nor an existing tokenizer.json file.")
    return HFTokenizer(path)


def _builder(path: str | Path) -> str | None:
    name = str(path).removesuffix(".gz")
    return _BUILDERS.get(os.path.splitext(name)[1])


def resolve_source(data: str | None) -> list[Path] | Path | str:
    """(Cheap, no loading.) --data as a sorted list of files, a save_to_disk folder (Path), or a hub name (str)."""
    if data is None:
        return [CORPUS]
    kinds = ".txt, .jsonl, .json or .parquet (optionally .gz)"
    if any(c in data for c in "*?["):
        files = sorted(Path(p).resolve() for p in glob.glob(os.path.expanduser(data), recursive=True)
                       if _builder(p) and os.path.isfile(p))
        if not files:
            raise ValueError(f"--data glob {data!r} matches no {kinds} file.")
        return files
    path = Path(data).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return path
        files = sorted(p.resolve() for p in path.rglob("*") if p.is_file() and _builder(p)
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ValueError(f"--data folder {data!r} holds no {kinds} file.")
        return files
    if path.is_file():
        if not _builder(path):
            raise ValueError(f"--data file {data!r} is not {kinds}.")
        return [path.resolve()]
    if data.startswith((".", "/", "~")) or data.count("/") > 1 or _builder(data):
        raise ValueError(f"--data path {data!r} does not exist.")
    return data  # "name" or "org/name" on the Hugging Face Hub


def _load_from_disk(path: Path) -> datasets.Dataset:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"--data {str(path)!r} is a DatasetDict without a 'train' split (it has {list(ds)}).")
        ds = ds["train"]
    return ds


def _offline() -> bool:
    import datasets

    flag = os.environ.get("HF_DATASETS_OFFLINE", os.environ.get("HF_HUB_OFFLINE"))
    return datasets.config.HF_HUB_OFFLINE if flag is None else flag.upper() in {"1", "ON", "YES", "TRUE"}


def load_text_dataset(data: str | None, text_field: str = "text",
                      hf_cache_dir: str | Path | None = None) -> datasets.Dataset:
    """--data as a ``datasets.Dataset`` with one column "text", one row per document (a .txt
    file is one document; a .jsonl/.json/.parquet row's ``text_field`` is one). Files are read
    in sorted path order; ``hf_cache_dir`` receives their arrow conversion (None: HF's cache)."""
    import datasets

    src = resolve_source(data)
    if isinstance(src, list):
        parts = []
        for builder, group in itertools.groupby(src, key=_builder):  # runs of one format, in path order
            files = [str(p) for p in group]
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=hf_cache_dir, **kwargs)
            where = files[0] + (f" (and {len(files) - 1} more files)" if len(files) > 1 else "")
            parts.append(_text_column(ds, "text" if builder == "text" else text_field, where))
        return datasets.concatenate_datasets(parts)
    if isinstance(src, Path):
        return _text_column(_load_from_disk(src), text_field, str(src))
    if _offline():
        raise ValueError(f"--data {src!r} is not a local path, and datasets cannot come from the Hugging Face "
                         "Hub while HF_DATASETS_OFFLINE=1: pass a local file, folder or glob.")
    try:
        ds = datasets.load_dataset(src, split="train")
    except Exception as e:  # any failure becomes the one-sentence error
        raise ValueError(f"--data {src!r} is not a local path and did not load from the Hugging Face Hub "
                         f"({type(e).__name__}: {e}).") from e
    return _text_column(ds, text_field, src)


def _text_column(ds: datasets.Dataset, field: str, where: str) -> datasets.Dataset:
    """``ds`` reduced to its column ``field``, renamed "text", typed string (so parts concatenate)."""
    import datasets

    if field not in ds.column_names:
        raise ValueError(f"the data {where} has no --text-field {field!r} (its columns: {ds.column_names}).")
    ds = ds.select_columns([field]).rename_column(field, "text") if field != "text" else ds.select_columns(["text"])
    string = datasets.Value("string")
    return ds if ds.features["text"] == string else ds.cast_column("text", string)


def _cache_key(data: str | None, tokenizer: Tokenizer, text_field: str) -> dict:
    """What the cache file name hashes: the source's fingerprint, the tokenizer, the text field."""
    src = resolve_source(data)
    if isinstance(src, list):
        source = [[str(p), (st := p.stat()).st_size, st.st_mtime_ns] for p in src]
    elif isinstance(src, Path):
        source = f"save_to_disk:{_load_from_disk(src)._fingerprint}"
    else:
        source = f"hub:{src}"
    return {"version": _CACHE_VERSION, "source": source, "tokenizer": tokenizer.identity, "text_field": text_field}


def _build(data: str | None, tokenizer: Tokenizer, text_field: str, key: dict, npy: Path, num_proc: int | None) -> None:
    """Tokenize ``data`` into ``npy`` (uint16 ids if vocab_size <= 2^16, else uint32) and its
    meta json. Everything is written in a scratch folder next to them (arrow conversion, map
    output, the two files) and moved in with os.replace, the meta last: a meta file means a
    complete cache, and a failed build leaves nothing behind."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]

    def tokenize(batch: dict) -> dict:
        return {"ids": [np.asarray(ids + eos, dtype=dtype) for ids in tokenizer.encode_batch(batch["text"])]}

    npy.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=npy.parent, prefix="build-") as scratch:
        docs = load_text_dataset(data, text_field, hf_cache_dir=scratch)
        ids = docs.map(tokenize, batched=True, num_proc=num_proc, remove_columns=["text"], new_fingerprint=npy.stem,
                       cache_file_name=os.path.join(scratch, "ids.arrow"), desc="tokenizing")
        chunks = ids.data.column("ids").chunks
        n = sum(len(c.flatten()) for c in chunks)
        out = np.lib.format.open_memmap(os.path.join(scratch, "tokens.npy"), mode="w+", dtype=dtype, shape=(n,))
        at = 0
        for c in chunks:
            values = c.flatten().to_numpy(zero_copy_only=False)
            out[at:at + len(values)] = values
            at += len(values)
        out.flush()
        del out
        meta = {**key, "data": str(CORPUS if data is None else data), "tokens": n, "documents": len(docs),
                "dtype": np.dtype(dtype).name, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
        Path(scratch, "meta.json").write_text(json.dumps(meta, indent=1))
        os.replace(os.path.join(scratch, "tokens.npy"), npy)
        os.replace(os.path.join(scratch, "meta.json"), npy.with_suffix(".json"))


def load_tokens(data: str | None, tokenizer: Tokenizer, *, text_field: str = "text",
                cache_dir: str | Path | None = None, num_proc: int | None = None) -> np.ndarray:
    """The flat token stream t_0 .. t_{N-1} of ``data`` (None: the embedded corpus), each
    document followed by EOS, as a read-only memory map of <cache_dir>/tokens-<key>.npy.

    Every rank calls it. The first call for a key tokenizes (``Dataset.map(batched=True,
    num_proc=num_proc)``); with torch.distributed initialized only global rank 0 does, the
    others wait on ``dist.barrier()``. cache_dir (default $ZERO3D_DATA_CACHE or
    ~/.cache/zero3d/tokens) must be on a filesystem all ranks see."""
    cache_dir = Path(cache_dir or os.environ.get("ZERO3D_DATA_CACHE") or Path.home() / ".cache/zero3d/tokens")
    key = _cache_key(data, tokenizer, text_field)  # every rank: a bad --data fails everywhere alike
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    npy = cache_dir.expanduser() / f"tokens-{digest}.npy"
    distributed = dist.is_available() and dist.is_initialized()
    try:
        if (not distributed or dist.get_rank() == 0) and not npy.with_suffix(".json").exists():
            _build(data, tokenizer, text_field, key, npy, num_proc)
    finally:
        if distributed:
            dist.barrier()
    if not npy.with_suffix(".json").exists():
        raise RuntimeError(f"rank 0 did not build the token cache {npy} (see its error; cache_dir must be shared).")
    return np.load(npy, mmap_mode="r")


def _epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{epoch}".encode()).digest()[:8], "little")


class GlobalBatches:
    """Packed sequences in a seed-only order. With N tokens and L = seq_len there are
    S = (N - 1) // L sequences, sequence k = t[k*L : k*L + L + 1] (neighbours share one
    token). Epoch e visits them in the order perm_e = randperm(S) drawn from a
    torch.Generator seeded by hash(seed, e); global batch ``step`` is the sequences at
    positions [step*B, (step+1)*B) of perm_0 ‖ perm_1 ‖ ... (B = global_batch_size), so
    batches run across epoch ends and ``batch(step)`` is a pure function of step."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int) -> None:
        if seq_len < 1 or global_batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and global_batch_size={global_batch_size} must be >= 1.")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"the data has {len(tokens)} tokens, but one sequence of seq_len={seq_len} "
                             f"needs {seq_len + 1}: use more data or a shorter seq_len.")
        self.tokens, self.seq_len, self.global_batch_size, self.seed = tokens, seq_len, global_batch_size, seed
        self.n_sequences = (len(tokens) - 1) // seq_len
        self._perm: tuple[int, torch.Tensor | None] = (-1, None)

    def permutation(self, epoch: int) -> torch.Tensor:
        """perm_e: the order of the S sequence indices in epoch e."""
        if self._perm[0] != epoch:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.n_sequences, generator=generator))
        return self._perm[1]

    def epoch(self, step: int) -> float:
        """Epochs completed before global batch ``step``: step*B / S."""
        return step * self.global_batch_size / self.n_sequences

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_bs, labels_bs), int64 [B, seq_len], labels_bs[:, i] = inputs_bs[:, i + 1]
        for i < seq_len - 1."""
        b, s, L = self.global_batch_size, self.n_sequences, self.seq_len
        rows = []
        for p in range(step * b, (step + 1) * b):
            k = int(self.permutation(p // s)[p % s])
            rows.append(np.asarray(self.tokens[k * L:k * L + L + 1]))
        seqs = torch.from_numpy(np.stack(rows).astype(np.int64))
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def local_micro_batches(inputs_bs: torch.Tensor, labels_bs: torch.Tensor, dp_rank: int, dp: int,
                        micro_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """DP rank d's share of a global batch of B rows, rows [d*B/dp, (d+1)*B/dp) (Megatron
    order), as ``micro_batches`` consecutive (inputs, labels) pairs of B/(dp*micro_batches) rows."""
    rows = inputs_bs.shape[0]
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank} is not in [0, dp={dp}).")
    if rows % dp or (rows // dp) % micro_batches:
        raise ValueError(f"global_batch_size={rows} is not divisible by dp={dp} x micro_batches={micro_batches}.")
    local, b = rows // dp, rows // dp // micro_batches
    lo = dp_rank * local
    return [(inputs_bs[lo + j * b:lo + (j + 1) * b], labels_bs[lo + j * b:lo + (j + 1) * b])
            for j in range(micro_batches)]
