"""Marks: what a parameter is across ranks, written where the model is built and read by the
optimizer, gradient clipping and checkpoints.

- replicated over a group: every rank of it holds the same values (a TP-replicated norm,
  a tied embedding on two pipeline stages); the global grad norm counts it once there.
- tied over a group: one weight held by every rank of it; its gradient is the SUM of the
  ranks' gradients (it is also replicated there).
- partitioned along a dim: TP splits it; its tp = 1 tensor is the concatenation of the TP
  ranks' tensors along that dim.
- sequence-parallel over a group: its gradient is summed over the group before autograd
  accumulates it (`parallel.tensor.layers.sequence_parallel_grad_sync`).

Marks live on the module that owns the parameter, by name (`module._param_marks`), so
`copy.deepcopy` of any module above it copies them with the parameters (a deep-copied
`nn.Parameter` keeps no attributes). `param_marks(model)` is the one reader.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

Group = dist.ProcessGroup | None


@dataclasses.dataclass(frozen=True)
class ExpertMark:
    """A parameter holding this rank's experts of an MoE layer, stacked along `dim`: the
    experts are split over the ranks of `ep`, and the ranks holding the same experts (the
    expert-data-parallel ranks) are `shard` (and, with hybrid sharding, its `replicate`
    group): the groups a data-parallel optimizer reduces and shards it over, in place of its own."""

    ep: Group
    shard: Group
    replicate: Group = None
    dim: int = 0

    def __deepcopy__(self, memo: dict) -> ExpertMark:
        return self


@dataclasses.dataclass(frozen=True)
class ParamMarks:
    """The marks of one parameter (groups in marking order, each once)."""

    replicated: tuple[Group, ...] = ()
    tied: tuple[Group, ...] = ()
    partition_dim: int | None = None
    sequence_parallel: tuple[Group, ...] = ()
    expert: ExpertMark | None = None

    def __deepcopy__(self, memo: dict) -> ParamMarks:
        return self  # immutable, and process groups are shared, never copied

    def adding(self, field: str, group: Group) -> ParamMarks:
        """These marks with `group` added to `field` (unchanged if it is there already)."""
        groups = getattr(self, field)
        if any(g is group for g in groups):
            return self
        return dataclasses.replace(self, **{field: (*groups, group)})


NO_MARKS = ParamMarks()


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that directly holds parameter `name` (dotted, relative to `module`)."""
    prefix, _, leaf = name.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    if not isinstance(owner._parameters.get(leaf), nn.Parameter):
        raise ValueError(f"{type(module).__name__} has no parameter {name!r} to mark")
    return owner, leaf


def _update(module: nn.Module, name: str, change: Any) -> None:
    owner, leaf = _owner(module, name)
    marks = owner.__dict__.setdefault("_param_marks", {})
    marks[leaf] = change(marks.get(leaf, NO_MARKS))


def mark_replicated(module: nn.Module, name: str, group: Group) -> None:
    """Declare parameter `name` of `module` the same on every rank of `group`; marking the
    same group twice is a no-op."""
    _update(module, name, lambda m: m.adding("replicated", group))


def mark_tied(module: nn.Module, name: str, group: Group) -> None:
    """Declare parameter `name` of `module` one weight held by every rank of `group`: its
    gradient is summed there, and it is replicated there."""
    _update(module, name, lambda m: m.adding("replicated", group).adding("tied", group))


def mark_partitioned(module: nn.Module, name: str, dim: int) -> None:
    """Declare parameter `name` of `module` split by TP along `dim`."""
    _update(module, name, lambda m: dataclasses.replace(m, partition_dim=dim))


def mark_expert(module: nn.Module, name: str, ep: Group, shard: Group, replicate: Group = None, dim: int = 0) -> None:
    """Declare parameter `name` of `module` this rank's experts, stacked along `dim`, split
    over `ep`; its data-parallel groups are `shard` (and `replicate`): see `ExpertMark`."""
    _update(module, name, lambda m: dataclasses.replace(m, expert=ExpertMark(ep, shard, replicate, dim)))


def mark_sequence_parallel(module: nn.Module, name: str, group: Group) -> None:
    """Declare that parameter `name`'s gradient is summed over `group` before accumulation;
    it is replicated there too."""
    _update(module, name, lambda m: m.adding("replicated", group).adding("sequence_parallel", group))


def param_marks(model: nn.Module) -> dict[torch.Tensor, ParamMarks]:
    """Every marked parameter of `model` and its marks (a parameter held by several
    modules, such as a tied head, gets the union of their marks)."""
    out: dict[torch.Tensor, ParamMarks] = {}
    for module in model.modules():
        for name, marks in module.__dict__.get("_param_marks", {}).items():
            p = module._parameters.get(name)
            if p is None:
                continue
            have = out.get(p, NO_MARKS)
            for field in ("replicated", "tied", "sequence_parallel"):
                for group in getattr(marks, field):
                    have = have.adding(field, group)
            if marks.partition_dim is not None:
                have = dataclasses.replace(have, partition_dim=marks.partition_dim)
            if marks.expert is not None:
                have = dataclasses.replace(have, expert=marks.expert)
            out[p] = have
    return out
