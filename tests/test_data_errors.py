"""Bad training data ends a run with one sentence: each case is a
DataError naming the file (and line) at fault, what is wrong and what to do; in a
distributed run the rank that read the data raises it on every rank, and the command
prints it once and exits 2 on every rank, without tracebacks."""

from __future__ import annotations

import gzip
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist

from research import data as D
from research.errors import DataError
from tests.conftest import TINY_RUN
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BYTE = D.ByteTokenizer()
TINY = [*TINY_RUN, "--n-layers", "1", "--d-model", "16", "--global-batch-size", "2", "--steps", "1"]
RANDOM = bytes(range(11, 256)) * 4  # one line (no 0x0a); not UTF-8 (0x80 at column 118), gzip or parquet


def _lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _parquet(path: Path, **columns: pa.Array) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


# Each case writes its bad data under a folder and returns (the --data value, the file at fault).
def _empty_txt(d: Path) -> tuple[Path, Path]:
    (d / "a.txt").write_text("")
    return d / "a.txt", d / "a.txt"


def _folder_of_empty_txt(d: Path) -> tuple[Path, Path]:
    for name in ("a.txt", "b.txt"):
        (d / name).write_text("")
    return d, d


def _binary_txt(d: Path) -> tuple[Path, Path]:
    (d / "a.txt").write_bytes(RANDOM)
    return d / "a.txt", d / "a.txt"


def _binary_jsonl(d: Path) -> tuple[Path, Path]:
    (d / "a.jsonl").write_bytes(RANDOM)
    return d / "a.jsonl", d / "a.jsonl"


def _not_gzip(d: Path) -> tuple[Path, Path]:
    (d / "a.jsonl.gz").write_bytes(RANDOM)
    return d / "a.jsonl.gz", d / "a.jsonl.gz"


def _jsonl_without_field(d: Path) -> tuple[Path, Path]:
    return _lines(d / "a.jsonl", '{"body": "x", "n": 1}'), d / "a.jsonl"


def _parquet_without_field(d: Path) -> tuple[Path, Path]:
    return _parquet(d / "a.parquet", body=pa.array(["x"]), n=pa.array([1])), d / "a.parquet"


def _not_parquet(d: Path) -> tuple[Path, Path]:
    (d / "a.parquet").write_bytes(RANDOM)
    return d / "a.parquet", d / "a.parquet"


def _malformed_line(d: Path) -> tuple[Path, Path]:
    return _lines(d / "a.jsonl", '{"text": "ok"}', '{"text": "unterminated', '{"text": "ok"}'), d / "a.jsonl"


def _null_text(d: Path) -> tuple[Path, Path]:
    return _lines(d / "a.jsonl", '{"text": "ok"}', '{"text": null}'), d / "a.jsonl"


def _number_text(d: Path) -> tuple[Path, Path]:
    return _lines(d / "a.jsonl", '{"text": 5}', '{"text": 6}'), d / "a.jsonl"


def _mixed_text(d: Path) -> tuple[Path, Path]:
    return _lines(d / "a.jsonl", '{"text": "ok"}', '{"text": ["a", "b"]}'), d / "a.jsonl"


def _line_without_key(d: Path) -> tuple[Path, Path]:
    return _lines(d / "a.jsonl", '{"text": "ok"}', '{"body": "x"}'), d / "a.jsonl"


def _empty_jsonl(d: Path) -> tuple[Path, Path]:
    (d / "a.jsonl").write_text("")
    return d / "a.jsonl", d / "a.jsonl"


def _parquet_null(d: Path) -> tuple[Path, Path]:
    return _parquet(d / "a.parquet", text=pa.array(["ok", None])), d / "a.parquet"


def _parquet_numbers(d: Path) -> tuple[Path, Path]:
    return _parquet(d / "a.parquet", text=pa.array([1, 2])), d / "a.parquet"


def _bad_file_among_good(d: Path) -> tuple[Path, Path]:
    """The culprit is the second of three files that datasets reads together."""
    _lines(d / "a.jsonl", '{"text": "ok"}')
    _lines(d / "b.jsonl", '{"text": "ok"}', '{"text": null}')
    with gzip.open(d / "c.jsonl.gz", "wt") as f:
        f.write('{"text": "ok"}\n')
    return d, d / "b.jsonl"


def _saved_dataset_with_null(d: Path) -> tuple[Path, Path]:
    datasets.Dataset.from_dict({"text": ["ok", None]}).save_to_disk(str(d / "ds"))
    return d / "ds", d / "ds"


CASES: dict[str, tuple[Callable[[Path], tuple[Path, Path]], str]] = {
    "empty txt": (_empty_txt, r"^--data {data} holds no text, only empty documents: give it files with text\.$"),
    "folder of empty txt": (_folder_of_empty_txt, r"^--data {data} holds no text"),
    "binary txt": (
        _binary_txt,
        r"^--data file {file} is not UTF-8 text \(line 1 has the byte 0x80 at column 118; "
        r"a binary file\?\): convert it to UTF-8 or leave it out of --data\.$",
    ),
    "binary jsonl": (_binary_jsonl, r"^--data file {file} is not UTF-8 text \(line 1"),
    "not gzip": (_not_gzip, r"^--data file {file} cannot be read \(Not a gzipped file"),
    "jsonl without field": (
        _jsonl_without_field,
        r"^--data {file} has no --text-field 'text' "
        r"\(its columns: body, n\): pass --text-field with the column "
        r"that holds the text\.$",
    ),
    "parquet without field": (
        _parquet_without_field,
        r"^--data {file} has no --text-field 'text' "
        r"\(its columns: body, n\)",
    ),
    "not parquet": (_not_parquet, r"^--data file {file} is not a readable parquet file \(.*\): replace it"),
    "malformed line": (
        _malformed_line,
        r"^line 2 of --data file {file} is not valid JSON \(Unterminated string "
        r"starting at column 10\): fix or delete that line\.$",
    ),
    "null text": (
        _null_text,
        r"^line 2 of --data file {file} has null as its 'text', not a string: "
        r"give each line a 'text' string, or delete the line\.$",
    ),
    "number text": (_number_text, r"^line 1 of --data file {file} has 5 as its 'text', not a string"),
    "list text": (_mixed_text, r"^line 2 of --data file {file} has \[\"a\", \"b\"\] as its 'text'"),
    "line without key": (_line_without_key, r"^line 2 of --data file {file} has no 'text' key \(its keys: body\)"),
    "empty jsonl": (_empty_jsonl, r"^--data file {file} is empty: give it one JSON object per line"),
    "parquet null": (_parquet_null, r"^row 1 of --data file {file} has a null --text-field 'text' \(nulls: 1\)"),
    "parquet numbers": (
        _parquet_numbers,
        r"^--text-field 'text' of --data file {file} holds int64 values, "
        r"not strings",
    ),
    "bad file among good": (_bad_file_among_good, r"^line 2 of --data file {file} has null as its 'text'"),
    "saved dataset with null": (_saved_dataset_with_null, r"^row 1 of --data {file} has a null --text-field 'text'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_is_one_sentence_naming_the_file(tmp_path: Path, case: str) -> None:
    make, pattern = CASES[case]
    (tmp_path / "data").mkdir()
    data, file = make(tmp_path / "data")
    with pytest.raises(DataError) as info:
        D.load_tokens(str(data), BYTE, cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert re.search(pattern.format(data=re.escape(str(data)), file=re.escape(str(file))), message), message
    assert not list((tmp_path / "cache").glob("*")), "a failed build left files in the cache"


def test_missing_paths_are_data_errors(tmp_path: Path) -> None:
    """(The command refuses these earlier, in config validation, as the same sentence.)"""
    with pytest.raises(DataError, match=r"--data path '.*nope.jsonl' does not exist"):
        D.load_tokens(str(tmp_path / "nope.jsonl"), BYTE, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=r"--data glob '.*\*.txt' matches no"):
        D.load_tokens(str(tmp_path / "*.txt"), BYTE, cache_dir=tmp_path / "cache")


def test_a_corpus_shorter_than_one_sequence_names_the_data_and_the_flag(tmp_path: Path) -> None:
    from research.config import parse_args
    from research.trainer import load_data

    data = tmp_path / "short.txt"
    data.write_text("tiny")  # 4 bytes + EOS = 5 tokens
    cfg = parse_args([*TINY, "--data", str(data), "--data-cache", str(tmp_path / "cache")], 1)
    with pytest.raises(
        DataError,
        match=rf"^--data {data} has 5 tokens, but one sequence of --seq-len=32 needs 33: "
        r"lower --seq-len or give more text\.$",
    ):
        load_data(cfg)


# --- distributed: rank 0 reads, every rank raises -------------------------------------------


def _errors(data: str, cache_dirs: list[str]) -> list[tuple[str, int | None]]:
    """(message, origin) of load_tokens on each cache dir; a dir named "rank0-only/..." is
    made private to rank 0 (a cache that the other ranks do not see)."""
    out = []
    for name in cache_dirs:
        cache_dir = os.path.join(name, str(dist.get_rank())) if "rank0-only" in name else name
        try:
            D.load_tokens(data, BYTE, cache_dir=cache_dir)
            out.append(("no error", None))
        except DataError as e:
            out.append((str(e), e.origin))
    return out


@pytest.mark.timeout(120)
def test_every_rank_raises_the_error_of_the_rank_that_found_it(tmp_path: Path) -> None:
    bad = str(_null_text(tmp_path)[0])
    good = str(_lines(tmp_path / "good.jsonl", '{"text": "some text"}'))
    rank0, rank1 = run_distributed(_errors, 2, bad, [str(tmp_path / "c1")], timeout=100)
    assert rank0 == rank1 and rank0[0][1] == 0 and rank0[0][0].startswith(f"line 2 of --data file {bad}")
    rank0, rank1 = run_distributed(_errors, 2, good, [str(tmp_path / "rank0-only")], timeout=100)
    assert rank0 == rank1 and rank1[0][1] == 1
    assert rank1[0][0].startswith("rank 1 does not see the token cache") and "--data-cache" in rank1[0][0]


# --- the command, with 2 processes -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(tmp_path: Path, data: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "experiments.train",
        *TINY,
        "--data",
        str(data),
        "--data-cache",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "run"),
    ]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["malformed line", "short corpus"])
def test_the_command_prints_one_sentence_and_every_rank_exits_2(tmp_path: Path, case: str) -> None:
    """Two processes of `python -m experiments.train` (the environment torchrun would give
    them): rank 0 finds the malformed line while rank 1 waits for the token cache; a corpus
    shorter than one sequence is found by both. Each exits 2, one `error:` line in all."""
    if case == "malformed line":
        data = _malformed_line(tmp_path)[0]
    else:
        data = tmp_path / "short.txt"
        data.write_text("tiny")
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            _command(tmp_path, data),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    text = "".join(out + err for out, err in outputs)
    assert [p.returncode for p in procs] == [2, 2], text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in text, text
    assert str(data) in errors[0] and errors[0] in outputs[0][1]  # printed by rank 0, which found it


@pytest.mark.timeout(150)
def test_under_torchrun_only_the_launcher_adds_its_summary(tmp_path: Path) -> None:
    """torchrun ends with its own ChildFailedError summary whenever a worker exits non-zero;
    apart from it, the output holds the one sentence and no traceback."""
    data = _malformed_line(tmp_path)[0]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        *_command(tmp_path, data)[1:],
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1"},
        check=False,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: line 2 of --data file {data}"), text
    assert text.count("Traceback") == 1 and "ChildFailedError" in text and "exitcode  : 2" in text, text
