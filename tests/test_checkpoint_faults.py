"""Checkpoints that cannot lie or attack, through the command a user runs: every damaged
file is one sentence naming it and exit 2 (no traceback); a pickle payload in DCP's
`.metadata` never runs, even when the attacker also fixed the recorded digests; `latest`
naming a lost step falls back to the newest complete one; interrupted `.tmp` folders go
at the next save; a save that runs out of space is one sentence, leaves no `.tmp` and
keeps the previous checkpoint as `latest`."""

from __future__ import annotations

import enum
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
from pathlib import Path, PosixPath

import pytest
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

from research import checkpoint, checkpoint_files
from tests.conftest import TINY_RUN

ROOT = Path(__file__).resolve().parents[1]
MARKER = "pwned"

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def command(
    cache: Path,
    *argv: str,
    launcher: tuple[str, ...] = (sys.executable,),
    limit_bytes: int | None = None,
) -> subprocess.CompletedProcess:
    """`python -m experiments.train` (or under `launcher`) with the tiny model and the token
    cache under `cache`; with
    `limit_bytes`, no file the run writes may grow past that size (RLIMIT_FSIZE: writes fail
    with EFBIG, the way a full disk fails them with ENOSPC)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run(
        train_argv(cache, *argv, launcher=launcher),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        preexec_fn=limit if limit_bytes else None,
        check=False,
    )


def train_argv(cache: Path, *argv: str, launcher: tuple[str, ...] = (sys.executable,)) -> list[str]:
    return [*launcher, "-m", "experiments.train", *TINY_RUN, "--data-cache", str(cache / "cache"), *argv]


def one_sentence(proc: subprocess.CompletedProcess) -> str:
    """The run's single `error:` line, after checking a non-zero exit and no traceback
    (torchrun prints its own when a worker exits non-zero)."""
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert text.count("Traceback") == text.count("ChildFailedError:"), text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, text[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root holding step_00000002 and step_00000004 of a one-process run."""
    tmp = tmp_path_factory.mktemp("ckpt")
    proc = command(tmp, "--steps", "4", "--save", str(tmp / "root"), "--save-every", "2", "--out", str(tmp / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


def resume(saved: Path, tmp: Path, load: Path) -> subprocess.CompletedProcess:
    """Steps 5-6 after the saved 4, on the saved run's LR schedule (its decay ends at step 4)."""
    return command(saved, "--steps", "6", "--lr-decay-steps", "4", "--load", str(load), "--out", str(tmp / "resumed"))


def damaged_copy(saved: Path, tmp: Path) -> Path:
    folder = tmp / "step_00000004"
    shutil.copytree(saved / "root" / "step_00000004", folder)
    return folder


def shard(folder: Path) -> Path:
    return next(folder.glob("*.distcp"))


def flip(path: Path, offset: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def write_payload(path: Path, marker: Path) -> None:
    """A pickle that would create `marker` when unpickled."""

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path.write_bytes(pickle.dumps(Payload()))


def reseal(folder: Path) -> None:
    """What an attacker who also edits meta.json does: record the current files' digests."""
    meta = checkpoint_files.unseal(json.loads((folder / "meta.json").read_text()), str(folder))
    meta["files"] = checkpoint_files.digests(str(folder), sorted(meta["files"]))
    (folder / "meta.json").write_text(json.dumps(checkpoint_files.seal(meta)))


def test_an_intact_checkpoint_records_every_file(saved: Path) -> None:
    folder = saved / "root" / "step_00000004"
    meta = checkpoint.read_meta(str(folder))
    assert sorted(meta["files"]) == checkpoint_files.file_names(str(folder))
    assert {".metadata", "rng/rank_0.pt", shard(folder).name} <= set(meta["files"])
    checkpoint_files.verify(str(folder), meta["files"], sorted(meta["files"]))


DAMAGES = [
    ("flip 64 bytes of a shard", "__0_0.distcp is damaged (its SHA-256 differs"),
    ("truncate a shard", "__0_0.distcp is damaged ("),
    ("delete an RNG file", "rng/rank_0.pt is missing"),
    ("flip bytes of meta.json", "meta.json"),
    ("meta.json is {}", "meta.json has no meta_sha256"),
    ("edit a value in meta.json", "meta.json was altered after the save"),
    ("pickle payload as .metadata", ".metadata is damaged"),
    ("pickle payload as .metadata, digests rewritten", ".metadata is not DCP tensor metadata"),
]


def damage(folder: Path, case: str, marker: Path) -> None:
    meta_file = folder / "meta.json"
    if case == "flip 64 bytes of a shard":
        flip(shard(folder), shard(folder).stat().st_size // 2, 64)
    elif case == "truncate a shard":
        os.truncate(shard(folder), 100)
    elif case == "delete an RNG file":
        (folder / "rng" / "rank_0.pt").unlink()
    elif case == "flip bytes of meta.json":
        flip(meta_file, 40, 8)
    elif case == "meta.json is {}":
        meta_file.write_text("{}")
    elif case == "edit a value in meta.json":
        meta_file.write_text(meta_file.read_text().replace('"step": 4', '"step": 3'))
    else:
        write_payload(folder / ".metadata", marker)
        if case.endswith("digests rewritten"):
            reseal(folder)


@pytest.fixture(scope="module")
def damaged(
    saved: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path, subprocess.CompletedProcess]]:
    """Each case's damaged copy of step 4 and the command resuming from it: (its folder, its
    temporary folder, the finished command). The commands run at once: each is mostly the
    start of a Python process with torch, so together they take the time of a few."""
    started = {}
    for case, _ in DAMAGES:
        tmp = tmp_path_factory.mktemp("damaged")
        folder = damaged_copy(saved, tmp)
        damage(folder, case, tmp / MARKER)
        argv = train_argv(saved, "--steps", "6", "--load", str(folder), "--out", str(tmp / "resumed"))
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started[case] = (folder, tmp, proc)
    done = {}
    for case, (folder, tmp, proc) in started.items():
        stdout, stderr = proc.communicate(timeout=240)
        done[case] = (folder, tmp, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return done


@pytest.mark.parametrize("case, expected", DAMAGES)
def test_a_damaged_checkpoint_is_one_sentence_naming_the_file(damaged, case: str, expected: str) -> None:
    folder, tmp, proc = damaged[case]
    sentence = one_sentence(proc)
    assert expected in sentence and str(folder) in sentence, sentence
    assert not (tmp / MARKER).exists()
    assert not (tmp / "resumed" / "metrics.jsonl").exists()


def test_export_refuses_a_damaged_checkpoint(saved: Path, tmp_path: Path) -> None:
    folder = damaged_copy(saved, tmp_path)
    flip(shard(folder), 200, 64)
    with pytest.raises(checkpoint.CheckpointError, match=r"__0_0\.distcp is damaged"):
        checkpoint.export(str(folder), str(tmp_path / "weights.pt"))


def test_latest_naming_a_lost_step_falls_back_to_the_newest_complete_one(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(saved / "root", root)
    (root / "step_00000004" / "meta.json").unlink()  # the newest save was cut short
    shutil.copytree(root / "step_00000002", root / "step_00000003.tmp")  # an interrupted one
    proc = resume(saved, tmp_path, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "warning: "
        f"{root}/latest names step_00000004, which is missing or incomplete; "
        "loading the newest complete checkpoint, step_00000002"
    ) in proc.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3, 4, 5, 6]
    shutil.rmtree(root / "step_00000004")
    proc = command(saved, "--steps", "4", "--load", str(root), "--save", str(root), "--out", str(tmp_path / "again"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"]


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")
def test_a_save_that_runs_out_of_space_keeps_the_previous_checkpoint(saved: Path, tmp_path: Path) -> None:
    """Two ranks resume from step 2 and save step 4 with files capped at 64 KiB (the shards
    are larger): one sentence, no `.tmp` left, `latest` still step_00000002 and loadable."""
    root = tmp_path / "root"
    shutil.copytree(saved / "root" / "step_00000002", root / "step_00000002")
    (root / "latest").write_text("step_00000002")
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    proc = command(
        saved,
        "--steps",
        "4",
        "--load",
        str(root),
        "--save",
        str(root),
        "--zero",
        "2",
        "--out",
        str(tmp_path / "run"),
        launcher=launcher,
        limit_bytes=64 << 10,
    )
    sentence = one_sentence(proc)
    assert sentence.startswith(f"error: saving the checkpoint {root}/step_00000004 failed (")
    assert sentence.endswith(
        f"{root}/latest still names step_00000002; free space on the disk or choose another --save"
    ), sentence
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]
    assert checkpoint.resolve(str(root)) == str(root / "step_00000002")


class _ByNamePickler(pickle.Pickler):
    """Pickles enum members as getattr(class, name), as Python 3.11.2 and 3.12+ do, and a
    marker object as getattr(PosixPath, "cwd"): a call that is not an enum member."""

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if isinstance(obj, _CallCwd):
            return getattr, (PosixPath, "cwd")
        return NotImplemented


class _CallCwd:
    """Stands for a pickled call that the metadata reader must refuse."""


def _metadata(extra: object = None) -> dcp_metadata.Metadata:
    chunk = dcp_metadata.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))
    props = dcp_metadata.TensorProperties(dtype=torch.float32)
    entries = {"w": dcp_metadata.TensorStorageMetadata(properties=props, size=torch.Size([2]), chunks=[chunk])}
    return dcp_metadata.Metadata(state_dict_metadata=entries, planner_data=extra)


def test_metadata_with_enum_members_pickled_by_name_loads_and_other_getattr_calls_are_refused(tmp_path: Path) -> None:
    for folder, extra in (("enum", None), ("call", _CallCwd())):
        (tmp_path / folder).mkdir()
        with open(tmp_path / folder / ".metadata", "wb") as f:
            _ByNamePickler(f).dump(_metadata(extra))
    loaded = checkpoint_files.read_dcp_metadata(str(tmp_path / "enum"))
    assert loaded.state_dict_metadata["w"].properties.memory_format == torch.contiguous_format
    with pytest.raises(checkpoint.CheckpointError, match="is not an enum member of DCP metadata"):
        checkpoint_files.read_dcp_metadata(str(tmp_path / "call"))
