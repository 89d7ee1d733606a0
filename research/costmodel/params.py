"""The parameters of a pipeline rank, read off the real model: `research.model.pipeline_chunks`
built on the meta device (no memory), its stage-3 units formed by `optim.stage3.stage3_units`
itself. Nothing here restates the model's structure.

The chunks are built for TP rank 0 of a `parallel.tensor.ShapeGroup` of size tp (a stand-in
group that sizes the layers without torch.distributed), so each parameter has the shape that
rank holds.

One block per chunk, exactly: every `Block` is built from the config alone (its index only
seeds its weights), and the blocks sit in a ModuleDict, which has no forward and so never
claims a unit. A chunk of n blocks therefore has n copies of one block's units, and its root
unit holds n copies of what the block left unclaimed (`tests/test_costmodel.py` compares
with the chunks built whole).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from optim.buffers import ALIGN
from optim.stage3 import is_called, stage3_units
from optim.zero import DEFAULT_UNIT_NUMEL, default_resident_numel
from parallel.pipeline.partition import layer_ranges
from parallel.pipeline.schedules import stage_of
from parallel.tensor import ShapeGroup
from research.model import GPTConfig, pipeline_chunks


class _NoInit(TorchFunctionMode):
    """Meta tensors hold no values, so initializers are skipped (`normal_` alone takes ~3 ms
    per weight on the meta device)."""

    SKIP = frozenset({torch.nn.init.normal_, torch.nn.init.uniform_, torch.Tensor.normal_, torch.Tensor.uniform_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIP:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


Size = tuple[int, int]  # (numel, numel with each parameter aligned to ALIGN elements)


def _size(params: list[torch.Tensor]) -> Size:
    return sum(p.numel() for p in params), sum(-(-p.numel() // ALIGN) * ALIGN for p in params)


def rank_chunks(model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int) -> nn.ModuleList:
    """The chunks of pipeline rank `pp_rank` as one TP rank holds them, on the meta device,
    with one block per chunk (see the module docstring)."""
    model.validate_tp(tp)
    one_block = dataclasses.replace(model, n_layers=pp * virtual_stages)
    with torch.device("meta"), _NoInit():
        return nn.ModuleList(pipeline_chunks(one_block, pp_rank, pp, virtual_stages, ShapeGroup(tp)))


@dataclass(frozen=True)
class _ChunkUnits:
    """The stage-3 units of a chunk built with one block: the block's own units, the block's
    unclaimed part of the chunk's root unit, the rest of the root unit, the other units."""

    block: tuple[Size, ...]
    root_block: Size
    root_rest: Size
    other: tuple[Size, ...]

    def with_layers(self, n: int) -> list[Size]:
        """The units of the same chunk with n blocks."""
        root = (self.root_rest[0] + n * self.root_block[0], self.root_rest[1] + n * self.root_block[1])
        return [*self.other, *self.block * n] + ([root] if root[0] else [])


def _classify(chunks: nn.ModuleList, unit_numel: int) -> list[_ChunkUnits]:
    """`optim.stage3.stage3_units` of one-block chunks, sorted into `_ChunkUnits` per chunk."""
    owner: dict[int, tuple[int, bool]] = {}  # module -> (its chunk, whether inside the block)
    for chunk in chunks:
        if is_called(chunk.blocks):
            raise TypeError("the blocks' container has a forward: one block no longer stands for all")
        owner.update({id(m): (id(chunk), True) for block in chunk.blocks.values() for m in block.modules()})
        for m in chunk.modules():
            owner.setdefault(id(m), (id(chunk), False))
    parts = {id(chunk): ([], [], [], []) for chunk in chunks}  # block, root_block, root_rest, other
    for module, params in stage3_units(chunks, set(chunks.parameters()), unit_numel):
        chunk, in_block = owner[id(module)]
        block, root_block, root_rest, other = parts[chunk]
        if in_block:
            block.append(_size(params))
        elif id(module) == chunk:
            held = {id(p) for b in module.blocks.values() for p in b.parameters()}
            root_block += [p for p in params if id(p) in held]
            root_rest += [p for p in params if id(p) not in held]
        else:
            other.append(_size(params))
    return [_ChunkUnits(tuple(b), _size(rb), _size(rr), tuple(o)) for b, rb, rr, o in parts.values()]


_CHUNK_UNITS: dict[tuple, list[_ChunkUnits]] = {}


def unit_sizes(
    model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int, unit_numel: int = DEFAULT_UNIT_NUMEL
) -> list[Size]:
    """(numel, aligned numel) of the stage-3 units of pipeline rank `pp_rank`, which together
    hold all its parameters: those of `rank_chunks`, each chunk's block repeated once per
    layer `layer_ranges` gives it. The one-block units are memoized by what the chunks'
    structure depends on: the model less its depth, tp, each chunk's place (first / last)."""
    stages = pp * virtual_stages
    ranges = layer_ranges(model.n_layers, stages)
    chunk_stages = [stage_of(pp_rank, c, pp) for c in range(virtual_stages)]
    places = tuple((stage == 0, stage == stages - 1) for stage in chunk_stages)
    key = (*(v for k, v in vars(model).items() if k != "n_layers"), tp, places, unit_numel)
    if key not in _CHUNK_UNITS:
        _CHUNK_UNITS[key] = _classify(rank_chunks(model, tp, pp, virtual_stages, pp_rank), unit_numel)
    return [u for c, stage in zip(_CHUNK_UNITS[key], chunk_stages) for u in c.with_layers(len(ranges[stage]))]


@dataclass(frozen=True)
class RankParams:
    """The parameters of one rank of a pipeline rank, as ZeroOptimizer holds them."""

    numel: int
    aligned: int  # each parameter aligned to ALIGN elements: what the buckets hold
    resident: int  # aligned numel in stage-3 units below the resident size (kept whole)
    largest_units: int  # aligned numel of the two largest sharded stage-3 units (gathered at once)


_RANK_PARAMS: dict[tuple, RankParams] = {}


def rank_params(
    model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int, unit_numel: int = DEFAULT_UNIT_NUMEL
) -> RankParams:
    """`RankParams` of pipeline rank `pp_rank` (memoized)."""
    key = (*vars(model).values(), tp, pp, virtual_stages, pp_rank, unit_numel)
    if key not in _RANK_PARAMS:
        units = unit_sizes(model, tp, pp, virtual_stages, pp_rank, unit_numel)
        resident = default_resident_numel(unit_numel)
        sharded = sorted((a for raw, a in units if raw >= resident), reverse=True)
        _RANK_PARAMS[key] = RankParams(
            numel=sum(raw for raw, _ in units),
            aligned=sum(a for _, a in units),
            resident=sum(a for raw, a in units if raw < resident),
            largest_units=sum(sharded[:2]),
        )
    return _RANK_PARAMS[key]
