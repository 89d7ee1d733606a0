"""The files of a checkpoint folder, checked: nothing read from it can lie or run code.

- Every file's SHA-256 and size are recorded in `meta.json` at save (`digests`) and
  compared at load (`verify`), so a flipped byte, a truncated shard or a replaced file is
  one sentence naming the file.
- `meta.json` carries the SHA-256 of its own canonical JSON (`seal` / `unseal`), so an
  edit that leaves valid JSON is caught too.
- DCP's `.metadata` is a pickle. `SafeReader` reads it with an unpickler that builds only
  DCP's own metadata types (tensor shapes, dtypes, chunk offsets, file offsets); anything
  else, such as a payload that would call `os.system`, is refused before it is built.
  Tensor data is read by DCP with `torch.load(weights_only=True)`; byte items, which DCP
  would unpickle freely, cannot appear because their metadata type is not allowed.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import json
import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from research.errors import CheckpointError

META = "meta.json"
SEAL = "meta_sha256"
_CHUNK = 1 << 22


def file_names(folder: str) -> list[str]:
    """Relative paths of the files under `folder` that a checkpoint consists of (all but
    meta.json, which is sealed separately), sorted."""
    names = []
    for dirpath, _, files in os.walk(folder):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            if rel != META and not rel.endswith(".part"):
                names.append(rel)
    return sorted(names)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def digests(folder: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {"bytes": size, "sha256": hex}} of the files `names` under `folder`."""
    return {
        n: {"bytes": os.path.getsize(os.path.join(folder, n)), "sha256": sha256_of(os.path.join(folder, n))}
        for n in names
    }


def verify(folder: str, recorded: dict[str, dict[str, Any]], names: list[str]) -> None:
    """CheckpointError naming the first of `names` that is missing, of another size, or whose
    SHA-256 differs from `recorded` (what the save wrote)."""
    for name in names:
        path = os.path.join(folder, name)
        want = recorded[name]
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {folder}: {name} is missing; restore it or load another checkpoint")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint {folder}: {name} is damaged ({size} bytes, {want['bytes']} at save); "
                "restore it or load another checkpoint"
            )
        if sha256_of(path) != want["sha256"]:
            raise CheckpointError(
                f"checkpoint {folder}: {name} is damaged (its SHA-256 differs from the one recorded "
                "at save); restore it or load another checkpoint"
            )


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(body: dict[str, Any]) -> dict[str, Any]:
    """`body` plus the SHA-256 of its canonical JSON."""
    return {**body, SEAL: hashlib.sha256(_canonical(body)).hexdigest()}


def unseal(sealed: Any, where: str) -> dict[str, Any]:
    """The body of a sealed meta.json; CheckpointError if it is not one or was altered."""
    if not isinstance(sealed, dict) or SEAL not in sealed:
        raise CheckpointError(
            f"checkpoint {where}: {META} has no {SEAL} (not written by this zero3d, or truncated); "
            "load another checkpoint"
        )
    body = {k: v for k, v in sealed.items() if k != SEAL}
    if hashlib.sha256(_canonical(body)).hexdigest() != sealed[SEAL]:
        raise CheckpointError(
            f"checkpoint {where}: {META} was altered after the save (its checksum differs); load another checkpoint"
        )
    return body


_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", *_DTYPES},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def _enum_member(cls: Any, name: str) -> Any:
    """`getattr(cls, name)` for a member of an allowed enum only: some Pythons (3.11.2, 3.12+)
    pickle an enum member as getattr(its class, its name), DCP's memory-format enum included."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__):
        raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not an enum member of DCP metadata")
    return cls[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata objects and plain data, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if name not in _ALLOWED.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")
        return super().find_class(module, name)


def read_dcp_metadata(folder: str) -> dcp_metadata.Metadata:
    """DCP's `.metadata` of `folder`, read without running code; CheckpointError if it holds
    anything but tensor metadata."""
    path = os.path.join(folder, ".metadata")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
    except OSError as e:
        raise CheckpointError(
            f"checkpoint {folder}: .metadata cannot be read ({e.strerror}); load another checkpoint"
        ) from None
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {folder}: .metadata is not DCP tensor metadata ({e}); refusing to load it"
        ) from None
    entries = getattr(metadata, "state_dict_metadata", None)
    if (
        not isinstance(metadata, dcp_metadata.Metadata)
        or not isinstance(entries, dict)
        or not all(isinstance(v, dcp_metadata.TensorStorageMetadata) for v in entries.values())
        or not all(isinstance(v, _StorageInfo) for v in (metadata.storage_data or {}).values())
    ):
        raise CheckpointError(f"checkpoint {folder}: .metadata is not DCP tensor metadata; refusing to load it")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """`dcp.FileSystemReader` whose `.metadata` goes through `read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_dcp_metadata(str(self.path))
        storage = metadata.storage_meta or dcp_metadata.StorageMeta()
        metadata.storage_meta = dataclasses.replace(storage, load_id=self.load_id)
        return metadata
