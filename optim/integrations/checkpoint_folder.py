"""The sharded checkpoint folder the Lightning and Fabric strategies write, in the layout of
those frameworks' FSDP strategies: a `torch.distributed.checkpoint` of the tensors (every rank
writes its own shards) and `META`, written by rank 0, with everything else.

A module trained by a ZeroOptimizer is saved with its trainable parameters as the optimizer's
fp32 masters (sharded tensors in each parameter's shape, `ZeroOptimizer.state_dict()["params"]`)
and its other entries as the module holds them; its optimizer's entry then leaves the masters
out, so they are written once. Both are canonical per parameter, so a folder loads at any world
size and stage: the module's entries are views of the masters, so loading them loads the
masters, and `load_into` then republishes the parameters (with the optimizer's loaded state,
when there is one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from optim.zero import ZeroOptimizer

META = "meta.pt"


def is_folder(path: Path) -> bool:
    """Whether `path` is a checkpoint folder (it holds META)."""
    return (path / META).is_file()


def module_entries(module: torch.nn.Module, zero: ZeroOptimizer | None) -> dict[str, torch.Tensor]:
    """`module.state_dict()` entries for DCP, each tensor under its first name only (a tied
    weight once): views of the module's own tensors, and with `zero` the trainable parameters
    as its sharded fp32 masters."""
    entries: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen or (zero is not None and isinstance(t, torch.nn.Parameter) and t.requires_grad):
            continue
        seen.add(id(t))
        entries[name] = t.detach()
    if zero is not None:
        entries.update(zero.state_dict()["params"])
    return entries


def optimizer_entries(state_dict: dict[str, Any], with_masters: bool) -> dict[str, Any]:
    """A ZeroOptimizer's sharded state dict for DCP, without the masters when its module's
    entries hold them."""
    return {k: v for k, v in state_dict.items() if with_masters or k != "params"}


def saved_keys(path: Path) -> set[str]:
    """The dotted names of every tensor and object in the folder's DCP checkpoint."""
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load_into(zero: ZeroOptimizer, own: dict[str, Any], loaded: dict[str, Any] | None) -> None:
    """After `dcp.load`: `zero` takes its loaded optimizer entries (None: only its masters were
    loaded, through the module's entries) and republishes its parameters. `own` is the state
    dict whose views the entries were loaded into."""
    zero.load_state_dict({**own, **(loaded or {}), "params": own["params"]})
