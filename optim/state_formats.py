"""The optimizer state dicts users reach for besides DCP, made safe.

`ZeroOptimizer.state_dict()` is sharded: each rank holds its own pieces. Two habits meet it:

* `torch.save(opt.state_dict(), path)` then `torch.load` + `load_state_dict`. Pickled, the
  state dict becomes a `RankLocalState`: this rank's pieces as plain tensors, with the rank,
  the group size and a fingerprint of the layout. Loading it is a collective check that
  every rank got the file its own rank saved under the same layout; otherwise every rank
  raises the same sentence (the usual mistake, saving on rank 0 only, can never hang).
* a plain `torch.optim` state dict (`{"state": {index: {...}}, "param_groups": [{"params":
  [indices], ...}]}`) of the same model: parameters are numbered as a torch optimizer built
  with the same param groups numbers them, each tensor is checked against its parameter's
  shape and its owned part copied in.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
import torch.distributed as dist

from parallel import comm

RANK_LOCAL = "zero3d_rank_local"


class ShardedStateDict(dict):
    """What `ZeroOptimizer.state_dict()` returns: a dict for DCP that pickles (torch.save)
    to this rank's pieces only, as a `RankLocalState`."""

    layout: dict[str, Any]

    def __reduce_ex__(self, protocol: int) -> tuple:
        return restore_rank_local, ({**self.layout, "state": _local(dict(self))},)

    def __deepcopy__(self, memo: dict) -> dict:
        return copy.deepcopy(dict(self), memo)


def restore_rank_local(payload: dict[str, Any]) -> dict[str, Any]:
    """Unpickled `ShardedStateDict`: a plain dict marked with RANK_LOCAL."""
    return {RANK_LOCAL: {k: v for k, v in payload.items() if k != "state"}, **payload["state"]}


torch.serialization.add_safe_globals([restore_rank_local])


def _local(value: Any) -> Any:
    """The nested state with each sharded tensor replaced by its local pieces (a list)."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and hasattr(value, "local_shards"):
        return [s.tensor.detach().clone() for s in value.local_shards()]
    return value


def fingerprint(stage: int, names_and_shapes: list[tuple[str, tuple[int, ...]]], buckets: list[list[str]]) -> str:
    """A short hash of everything that decides which pieces a rank holds."""
    return hashlib.sha256(repr((stage, names_and_shapes, buckets)).encode()).hexdigest()[:16]


def agree(problem: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise the lowest rank's problem on every rank of `group` (a collective), so a state
    dict that one rank cannot load never leaves the others waiting."""
    problems = comm.all_gather_object(problem, group=group)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise ValueError(first)


def check_rank_local(sd: dict[str, Any], layout: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Every rank loads the pieces its own rank saved, under the same layout."""
    saved = sd[RANK_LOCAL]
    everyone = comm.all_gather_object((saved["rank"], saved["world"], saved["layout"]), group=group)
    ranks = [r for r, _, _ in everyone]
    problem = None
    if any(w != layout["world"] or fp != layout["layout"] for _, w, fp in everyone):
        problem = (
            f"this optimizer state was saved with torch.save under another layout (group size {everyone[0][1]}, or another "
            "stage, model or bucket size); such a file loads only under the same one, so save with "
            "torch.distributed.checkpoint (dcp.save(opt.state_dict(), ...)) to load under any layout"
        )
    elif ranks != list(range(layout["world"])):
        problem = (
            f"ranks {list(range(layout['world']))} loaded optimizer state that torch.save wrote on ranks {ranks}: "
            "opt.state_dict() holds only this rank's shard, so torch.save it on every rank to a file of its own "
            "(or use torch.distributed.checkpoint: dcp.save(opt.state_dict(), checkpoint_id=...))"
        )
    agree(problem, group)


def is_torch_format(sd: Any) -> bool:
    """A state dict of a plain torch.optim optimizer."""
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    return isinstance(groups, (list, tuple)) and bool(groups) and isinstance(groups[0], dict) and "params" in groups[0]


def torch_format_problem(sd: dict[str, Any], order: list[list[tuple[str, torch.Size]]]) -> str | None:
    """Why a torch.optim state dict does not fit a ZeroOptimizer whose param groups hold
    `order` ([(name, shape)] per group, in torch's numbering order); None if it fits."""
    groups = sd["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g) for g in order]:
        return (
            f"the torch optimizer state has param groups of {[len(g['params']) for g in groups]} parameters and this "
            f"ZeroOptimizer {[len(g) for g in order]}; build both with the same param groups of trainable parameters"
        )
    for group, mine in zip(groups, order):
        for index, (name, shape) in zip(group["params"], mine):
            for key, value in sd["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shape:
                    return (
                        f"torch optimizer state {key!r} of parameter #{index} has shape {tuple(value.shape)}, but "
                        f"ZeroOptimizer's parameter #{index} is {name!r} of shape {tuple(shape)}; the state belongs to another model"
                    )
    return None
