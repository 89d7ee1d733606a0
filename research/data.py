"""Training data: HF ``datasets`` in, a cached flat token stream, fixed-length packed
sequences, and one global-batch order shared by every (tp, pp, dp) layout.

    --data -> Dataset with a "text" column                          load_text_dataset
           -> Dataset.map(batched): doc_i -> ids_i + [eos]          (inside load_tokens)
           -> flat stream t_0 .. t_{N-1}: <cache>/tokens-<key>.npy + .json, built once
              (by global rank 0), memory-mapped by every rank       load_tokens
    sequence k = t[k*L : k*L + L + 1]; inputs = [:-1], labels = [1:]          GlobalBatches
    global batch s = sequences at positions [s*B, (s+1)*B) of perm_0 ‖ perm_1 ‖ ...
    micro-batch j: rows [j*B/m, (j+1)*B/m), split over the dp ranks  local_micro_batches

Bad data is a `DataError`: one sentence naming the file (and line) at fault, what is wrong
and what to do. Only rank 0 reads the data, and it meets the other ranks in `raise_together`,
so its error ends every rank.

The cache key hashes the data source (file paths, sizes, mtimes; a saved dataset's
fingerprint; a hub name), the tokenizer (a hash of its file) and the text field, not
seq_len: packing slices the same stream for any length.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import itertools
import json
import os
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from research.errors import DataError, raise_together

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


def tokenizer_file(spec: str | None) -> Path | None:
    """(Cheap, no loading.) The ``tokenizers`` JSON file that --tokenizer names, None for bytes
    (None or "byte"); a ValueError when there is no such file."""
    if spec is None or spec == "byte":
        return None
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"--tokenizer {spec!r} is neither 'byte' nor an existing tokenizer.json file.")
    return path


def load_tokenizer(spec: str | None) -> Tokenizer:
    """None or "byte": ByteTokenizer; otherwise the path of a ``tokenizers`` JSON file."""
    path = tokenizer_file(spec)
    return ByteTokenizer() if path is None else HFTokenizer(path)


def _builder(path: str | Path) -> str | None:
    name = str(path).removesuffix(".gz")
    return _BUILDERS.get(os.path.splitext(name)[1])


def resolve_source(data: str | None) -> list[Path] | Path | str:
    """(Cheap, no loading.) --data as a sorted list of files, a save_to_disk folder (Path), or a hub name (str)."""
    if data is None:
        return [CORPUS]
    kinds = ".txt, .jsonl, .json or .parquet (optionally .gz)"
    if any(c in data for c in "*?["):
        files = sorted(
            Path(p).resolve()
            for p in glob.glob(os.path.expanduser(data), recursive=True)
            if _builder(p) and os.path.isfile(p)
        )
        if not files:
            raise DataError(f"--data glob {data!r} matches no {kinds} file.")
        return files
    path = Path(data).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return path
        files = sorted(
            p.resolve()
            for p in path.rglob("*")
            if p.is_file() and _builder(p) and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataError(f"--data folder {data!r} holds no {kinds} file.")
        return files
    if path.is_file():
        if not _builder(path):
            raise DataError(f"--data file {data!r} is not {kinds}.")
        return [path.resolve()]
    if data.startswith((".", "/", "~")) or data.count("/") > 1 or _builder(data):
        raise DataError(f"--data path {data!r} does not exist.")
    return data  # "name" or "org/name" on the Hugging Face Hub


def _load_from_disk(path: Path) -> datasets.Dataset:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"--data {str(path)!r} is a DatasetDict without a 'train' split (it has {list(ds)}).")
        ds = ds["train"]
    return ds


def hub_offline() -> bool:
    """Whether HF_DATASETS_OFFLINE / HF_HUB_OFFLINE (or datasets' own setting) forbid the Hub."""
    import datasets

    flag = os.environ.get("HF_DATASETS_OFFLINE", os.environ.get("HF_HUB_OFFLINE"))
    return datasets.config.HF_HUB_OFFLINE if flag is None else flag.upper() in {"1", "ON", "YES", "TRUE"}


def require_hub(name: str) -> None:
    """DataError unless the dataset `name` (not a local path) may come from the Hub."""
    if hub_offline():
        raise DataError(
            f"--data {name!r} is not a local path, and datasets cannot come from the Hugging Face "
            "Hub while it is offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE): pass a local file, "
            "folder or glob."
        )


def describe(data: str | None) -> str:
    """How error messages name a --data value."""
    return f"--data {data}" if data is not None else f"the embedded corpus research/{CORPUS.parent.name}/{CORPUS.name}"


def load_text_dataset(
    data: str | None, text_field: str = "text", hf_cache_dir: str | Path | None = None
) -> datasets.Dataset:
    """--data as a ``datasets.Dataset`` with one column "text", one row per document (a .txt
    file is one document; a .jsonl/.json/.parquet row's ``text_field`` is one). Files are read
    in sorted path order; ``hf_cache_dir`` receives their arrow conversion (None: HF's cache).
    Data that cannot be read, or a text field that is missing or not a string, is a DataError."""
    import datasets

    src = resolve_source(data)
    if isinstance(src, list):
        parts = [
            _read_files(builder, list(group), text_field, hf_cache_dir)
            for builder, group in itertools.groupby(src, key=_builder)
        ]  # runs of one format, in path order
        return datasets.concatenate_datasets(parts)
    if isinstance(src, Path):
        return _text_column(_load_from_disk(src), text_field, str(src))
    require_hub(src)
    try:
        ds = datasets.load_dataset(src, split="train")
    except Exception as e:  # any failure becomes the one-sentence error
        raise DataError(
            f"--data {src!r} is not a local path and did not load from the Hugging Face Hub ({type(e).__name__}: {e})."
        ) from e
    return _text_column(ds, text_field, src)


def _read_files(builder: str, files: list[Path], text_field: str, hf_cache_dir: str | Path | None) -> datasets.Dataset:
    """A run of files of one format through ``datasets.load_dataset``, as a "text" column.
    datasets does not say which file (or line) it failed on, so a failure is named by
    reading the files again in plain Python (`_find_problem`); its own log lines about the
    failure are silenced, so that the DataError is the one message."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    field = "text" if builder == "text" else text_field
    where = f"{files[0]}" + (f" (and {len(files) - 1} more files)" if len(files) > 1 else "")
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        ds = datasets.load_dataset(
            builder, data_files=[str(p) for p in files], split="train", cache_dir=hf_cache_dir, **kwargs
        )
    # StopIteration: the json builder finding no line in any file
    except (DatasetGenerationError, pa.ArrowException, OSError, EOFError, StopIteration) as e:
        cause = e.__cause__ or e
        raise DataError(
            _find_problem(builder, files, field)
            or f"--data {where} could not be read "
            f"({type(cause).__name__}: {cause}): check that the files are {builder} files."
        ) from e
    finally:
        datasets.logging.set_verbosity(verbosity)
    return _text_column(ds, field, where, locate=lambda: _find_problem(builder, files, field))


def _text_column(
    ds: datasets.Dataset, field: str, where: str, locate: Callable[[], str | None] = lambda: None
) -> datasets.Dataset:
    """``ds`` reduced to its column ``field``, renamed "text", typed string (so parts concatenate).
    A missing column, or a value in it that is null or not a string, is a DataError, worded by
    ``locate()`` (the file and line at fault) where it can."""
    import datasets

    if field not in ds.column_names:
        raise DataError(
            f"--data {where} has no --text-field {field!r} (its columns: {', '.join(ds.column_names)}): "
            "pass --text-field with the column that holds the text."
        )
    ds = ds.select_columns([field]).rename_column(field, "text") if field != "text" else ds.select_columns(["text"])
    problem = _column_problem(ds.data.column("text"), field, f"--data {where}")
    if problem:
        raise DataError(locate() or problem)
    string = datasets.Value("string")
    return ds if ds.features["text"] == string else ds.cast_column("text", string)


def _column_problem(column: pa.ChunkedArray, field: str, where: str) -> str | None:
    """The sentence for a text column that holds no strings or has a null, else None."""
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return (
            f"--text-field {field!r} of {where} holds {column.type} values, not strings: "
            "pass --text-field with the column that holds the text."
        )
    if column.null_count:
        row = pc.index(pc.is_null(column), True).as_py()
        return (
            f"row {row} of {where} has a null --text-field {field!r} (nulls: {column.null_count}): "
            "drop those rows or give them text."
        )
    return None


def _find_problem(builder: str, files: list[Path], field: str) -> str | None:
    """The first problem in ``files`` as a sentence naming the file (and line), or None if
    plain Python reads them fine. Slow on big files; only called once datasets has failed."""
    for path in files:
        try:
            problem = _parquet_problem(path, field) if builder == "parquet" else _lines_problem(path, builder, field)
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile, a truncated .gz, ...
            problem = f"--data file {path} cannot be read ({e}): replace it or leave it out of --data."
        if problem:
            return problem
    return None


def _lines_problem(path: Path, builder: str, field: str) -> str | None:
    """A .txt file's first non-UTF-8 line; a JSON-lines file's first line that is not JSON or
    has no string ``field`` (a .json array document is left to datasets' message)."""
    line = 0
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (
                    f"--data file {path} is not UTF-8 text (line {line} has the byte 0x{raw[e.start]:02x} at "
                    f"column {e.start + 1}; a binary file?): convert it to UTF-8 or leave it out of --data."
                )
            if builder != "json" or not text.strip():
                continue
            if line == 1 and text.lstrip().startswith("["):
                return None  # a JSON array, not JSON lines
            try:
                row = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                what = f"{e.msg.removesuffix(' at')} at column {e.colno}"
                return f"line {line} of --data file {path} is not valid JSON ({what}): fix or delete that line."
            if not isinstance(row, dict):
                wrong = f"is a JSON {type(row).__name__}, not an object with a {field!r} key"
            elif field not in row:
                wrong = f"has no {field!r} key (its keys: {', '.join(row)})"
            elif not isinstance(row[field], str):
                wrong = f"has {json.dumps(row[field])[:40]} as its {field!r}, not a string"
            else:
                continue
            return f"line {line} of --data file {path} {wrong}: give each line a {field!r} string, or delete the line."
    if builder == "json" and line == 0:
        return f"--data file {path} is empty: give it one JSON object per line, with a {field!r} string."
    return None


def _parquet_problem(path: Path, field: str) -> str | None:
    """A parquet file that pyarrow cannot read, or whose ``field`` column is missing, not
    strings, or has a null."""
    try:
        schema = pq.read_schema(path)
        if field not in schema.names:
            return (
                f"--data file {path} has no --text-field {field!r} (its columns: {', '.join(schema.names)}): "
                "pass --text-field with the column that holds the text."
            )
        column = pq.read_table(path, columns=[field]).column(field)
    except pa.ArrowException as e:
        return f"--data file {path} is not a readable parquet file ({e}): replace it or leave it out of --data."
    return _column_problem(column, field, f"--data file {path}")


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
    complete cache, and a failed build leaves nothing behind. Data without text is a DataError."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]

    def tokenize(batch: dict) -> dict:
        return {"ids": [np.asarray(ids + eos, dtype=dtype) for ids in tokenizer.encode_batch(batch["text"])]}

    npy.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=npy.parent, prefix="build-") as scratch:
        docs = load_text_dataset(data, text_field, hf_cache_dir=scratch)
        ids = docs.map(
            tokenize,
            batched=True,
            num_proc=num_proc,
            remove_columns=["text"],
            new_fingerprint=npy.stem,
            cache_file_name=os.path.join(scratch, "ids.arrow"),
            desc="tokenizing",
        )
        chunks = ids.data.column("ids").chunks
        n = sum(len(c.flatten()) for c in chunks)
        if n == len(docs) * len(eos):
            raise DataError(f"{describe(data)} holds no text, only empty documents: give it files with text.")
        out = np.lib.format.open_memmap(os.path.join(scratch, "tokens.npy"), mode="w+", dtype=dtype, shape=(n,))
        at = 0
        for c in chunks:
            values = c.flatten().to_numpy(zero_copy_only=False)
            out[at : at + len(values)] = values
            at += len(values)
        out.flush()
        del out
        meta = {
            **key,
            "data": str(CORPUS if data is None else data),
            "tokens": n,
            "documents": len(docs),
            "dtype": np.dtype(dtype).name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        }
        Path(scratch, "meta.json").write_text(json.dumps(meta, indent=1))
        os.replace(os.path.join(scratch, "tokens.npy"), npy)
        os.replace(os.path.join(scratch, "meta.json"), npy.with_suffix(".json"))


def load_tokens(
    data: str | None,
    tokenizer: Tokenizer,
    *,
    text_field: str = "text",
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
) -> np.ndarray:
    """The flat token stream t_0 .. t_{N-1} of ``data`` (None: the embedded corpus), each
    document followed by EOS, as a read-only memory map of <cache_dir>/tokens-<key>.npy.

    Every rank calls it. The first call for a key tokenizes (``Dataset.map(batched=True,
    num_proc=num_proc)``); with torch.distributed initialized only global rank 0 does, the
    others wait in `raise_together`, so that rank 0's DataError is raised on every rank (and
    printed by rank 0 only). cache_dir (default $ZERO3D_DATA_CACHE or ~/.cache/zero3d/tokens)
    must be on a filesystem all ranks see; a rank that does not see the cache raises DataError."""
    cache_dir = Path(cache_dir or os.environ.get("ZERO3D_DATA_CACHE") or Path.home() / ".cache/zero3d/tokens")
    key = _cache_key(data, tokenizer, text_field)  # every rank: a bad --data fails everywhere alike
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    npy = cache_dir.expanduser() / f"tokens-{digest}.npy"
    meta = npy.with_suffix(".json")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def build() -> None:
        if rank == 0 and not meta.exists():
            _build(data, tokenizer, text_field, key, npy, num_proc)

    def check_shared() -> None:
        if not meta.exists():
            raise DataError(
                f"rank {rank} does not see the token cache {meta} that rank 0 built: "
                "--data-cache must be a folder that every rank sees."
            )

    raise_together(build)  # the ranks meet here
    raise_together(check_shared)
    return np.load(npy, mmap_mode="r")


def _epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{epoch}".encode()).digest()[:8], "little")


class GlobalBatches:
    """Packed sequences in a seed-only order. With N tokens and L = seq_len there are
    S = (N - 1) // L sequences, sequence k = t[k*L : k*L + L + 1] (neighbours share one
    token). Epoch e visits them in the order perm_e = randperm(S) drawn from a
    torch.Generator seeded by hash(seed, e); global batch ``step`` is the sequences at
    positions [step*B, (step+1)*B) of perm_0 ‖ perm_1 ‖ ... (B = global_batch_size), so
    batches run across epoch ends and ``batch(step)`` is a pure function of step (so a global
    batch may hold more sequences than the data has). ``source`` names the data in the
    DataError of a stream shorter than one sequence."""

    def __init__(
        self, tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int, source: str = "the data"
    ) -> None:
        if seq_len < 1 or global_batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and global_batch_size={global_batch_size} must be >= 1.")
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"{source} has {len(tokens)} tokens, but one sequence of --seq-len={seq_len} "
                f"needs {seq_len + 1}: lower --seq-len or give more text."
            )
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
            rows.append(np.asarray(self.tokens[k * L : k * L + L + 1]))
        seqs = torch.from_numpy(np.stack(rows).astype(np.int64))
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def local_micro_batches(
    inputs_bs: torch.Tensor, labels_bs: torch.Tensor, dp_rank: int, dp: int, micro_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """DP rank d's share of a global batch of B rows: ``micro_batches`` (inputs, labels) pairs
    of b = B/(dp·m) rows, micro-batch j holding rows [j·B/m + d·b, j·B/m + (d+1)·b). Micro-batch
    j of all dp ranks together is then rows [j·B/m, (j+1)·B/m), micro-batch j of a
    one-process run with the same m, whatever dp is: statistics taken over a micro-batch
    (MoE load balancing) do not depend on the layout."""
    rows = inputs_bs.shape[0]
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank} is not in [0, dp={dp}).")
    if rows % dp or (rows // dp) % micro_batches:
        raise ValueError(f"global_batch_size={rows} is not divisible by dp={dp} x micro_batches={micro_batches}.")
    per_micro, b = rows // micro_batches, rows // dp // micro_batches
    starts = [j * per_micro + dp_rank * b for j in range(micro_batches)]
    return [(inputs_bs[lo : lo + b], labels_bs[lo : lo + b]) for lo in starts]
