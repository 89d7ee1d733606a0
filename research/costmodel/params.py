"""The parameters of a pipeline rank, read off the real model: `research.model.pipeline_chunks`
built on the meta device (no memory), its stage-3 units formed by `optim.stage3.stage3_units`
itself. Nothing here restates the model's structure.

The chunks are built for TP rank 0 of a `parallel.tensor.ShapeGroup` of size tp (a stand-in
group that sizes the layers without torch.distributed), so each parameter has the shape that
rank holds.

One block per chunk, exactly: every `Block` is built from the config alone (its index only
seeds its weights, and decides whether its MLP is an MoE one), and the blocks sit in a
ModuleDict, which has no forward and so never claims a unit. A chunk of n blocks therefore
has n copies of one block's units (with MoE: of a dense or an MoE block's, as each layer is),
and its root unit holds n copies of what the block left unclaimed (`tests/test_costmodel.py`
compares with the chunks built whole).

Passes. What the step-time model needs of a rank's collectives (`research.costmodel.dpcomm`):
each chunk's units in the order forward uses them (the chunk's root unit first, as its
forward hook fires first, then the units before its blocks, the blocks', those after), cut
into `Slot`s, and the same for its stages 0-2 gradient buckets. A unit or bucket costs one
collective per bucket key (`_bucket_key`), as `ZeroOptimizer` buckets it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from optim.buffers import ALIGN, bucket_key
from optim.policies import DEFAULT_BUCKET_NUMEL, DEFAULT_UNIT_NUMEL, default_resident_numel
from optim.stage3 import has_own_forward, stage3_units
from parallel.marks import NO_MARKS, ParamMarks, param_marks
from parallel.pipeline.partition import layer_ranges
from parallel.pipeline.schedules import stage_of
from parallel.tensor import ShapeGroup
from research.model import GPT, GPTConfig, pipeline_chunks
from research.moe import Experts


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
Key = tuple  # what a bucket's parameters share (`_bucket_key`)
Parts = dict[Key, Size]  # a unit's parameters by bucket key


def _bucket_key(p: torch.Tensor, marks: dict[torch.Tensor, ParamMarks], experts: set[int]) -> Key:
    """`optim.buffers.bucket_key` inside one root module, with the Trainer's param group
    (`research.trainer.weight_decay_groups`: matrices decay, vectors do not), and last
    whether the parameter holds MoE experts (their own buckets, split over ep)."""
    return (*bucket_key(p.dim() >= 2, None, marks.get(p, NO_MARKS)), id(p) in experts)


def _parts(params: list[torch.Tensor], marks: dict[torch.Tensor, ParamMarks], experts: set[int]) -> Parts:
    """(numel, aligned numel) of `params` by bucket key."""
    parts: Parts = {}
    for p in params:
        key = _bucket_key(p, marks, experts)
        numel, aligned = parts.get(key, (0, 0))
        parts[key] = (numel + p.numel(), aligned + -(-p.numel() // ALIGN) * ALIGN)
    return parts


def _size(parts: Parts) -> Size:
    return sum(n for n, _ in parts.values()), sum(a for _, a in parts.values())


def _merged(*weighted: tuple[Parts, int]) -> Parts:
    """The sum over (parts, times) of `times` copies of `parts`."""
    out: Parts = {}
    for parts, times in weighted:
        for key, (numel, aligned) in parts.items():
            have = out.get(key, (0, 0))
            out[key] = (have[0] + times * numel, have[1] + times * aligned)
    return out


def rank_chunks(model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int) -> nn.ModuleList:
    """The chunks of pipeline rank `pp_rank` as one TP rank holds them, on the meta device,
    with one block per chunk (see the module docstring)."""
    model.validate_tp(tp)
    one_block = dataclasses.replace(model, n_layers=pp * virtual_stages)
    with torch.device("meta"), _NoInit():
        return nn.ModuleList(pipeline_chunks(one_block, pp_rank, pp, virtual_stages, ShapeGroup(tp)))


@dataclass(frozen=True)
class _ChunkUnits:
    """The stage-3 units of a chunk built with one block, by bucket key: the units before the
    block and after it (post-order), the block's own, the block's unclaimed part of the
    chunk's root unit, the rest of the root unit."""

    before: tuple[Parts, ...]
    block: tuple[Parts, ...]
    after: tuple[Parts, ...]
    root_block: Parts
    root_rest: Parts

    def with_layers(self, n: int) -> list[Parts]:
        """The units of the same chunk with n blocks, in the order forward uses them: the root
        unit first (its forward hook fires first), then post-order."""
        return self.with_blocks([self] * n)

    def with_blocks(self, kinds: list[_ChunkUnits]) -> list[Parts]:
        """The units of this chunk with one block of each of `kinds` (a dense block's
        `_ChunkUnits` or an MoE block's), in order: the root unit holds each block's unclaimed
        part."""
        root = _merged((self.root_rest, 1), *((kind.root_block, 1) for kind in kinds))
        return ([root] if root else []) + [*self.before, *(u for kind in kinds for u in kind.block), *self.after]


def _classify(chunks: nn.ModuleList, unit_numel: int) -> list[_ChunkUnits]:
    """`optim.stage3.stage3_units` of one-block chunks, sorted into `_ChunkUnits` per chunk."""
    owner: dict[int, tuple[int, bool]] = {}  # module -> (its chunk, whether inside the block)
    for chunk in chunks:
        if has_own_forward(chunk.blocks):
            raise TypeError("the blocks' container has a forward: one block no longer stands for all")
        owner.update({id(m): (id(chunk), True) for block in chunk.blocks.values() for m in block.modules()})
        for m in chunk.modules():
            owner.setdefault(id(m), (id(chunk), False))
    marks = param_marks(chunks)
    experts = {id(p) for m in chunks.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)}
    found = {id(chunk): ([], [], [], [], []) for chunk in chunks}  # before, block, after, root_block, root_rest
    for module, params in stage3_units(chunks, set(chunks.parameters()), unit_numel):
        chunk, in_block = owner[id(module)]
        before, block, after, root_block, root_rest = found[chunk]
        if in_block:
            block.append(_parts(params, marks, experts))
        elif id(module) == chunk:
            held = {id(p) for b in module.blocks.values() for p in b.parameters()}
            root_block += [p for p in params if id(p) in held]
            root_rest += [p for p in params if id(p) not in held]
        else:
            (after if block else before).append(_parts(params, marks, experts))
    return [
        _ChunkUnits(tuple(b), tuple(k), tuple(a), _parts(rb, marks, experts), _parts(rr, marks, experts))
        for b, k, a, rb, rr in found.values()
    ]


_CHUNK_UNITS: dict[tuple, list[_ChunkUnits]] = {}


def _chunk_units(
    model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int, unit_numel: int
) -> list[list[Parts]]:
    """Per chunk of pipeline rank `pp_rank`, its stage-3 units in the order forward uses them:
    those of `rank_chunks`, each chunk's block repeated once per layer `layer_ranges` gives
    it. The one-block units are memoized by what the chunks' structure depends on: the model
    less its depth, tp, each chunk's place (first / last)."""
    stages = pp * virtual_stages
    ranges = layer_ranges(model.n_layers, stages)
    chunk_stages = [stage_of(pp_rank, c, pp) for c in range(virtual_stages)]
    if not model.moe_experts:
        one = _one_block_units(model, tp, pp, virtual_stages, pp_rank, unit_numel)
        return [c.with_layers(len(ranges[stage])) for c, stage in zip(one, chunk_stages)]
    # MoE every `moe_every` blocks: one-block chunks of each kind, each layer taking its own
    dense = _one_block_units(dataclasses.replace(model, moe_experts=0), tp, pp, virtual_stages, pp_rank, unit_numel)
    moe = _one_block_units(dataclasses.replace(model, moe_every=1), tp, pp, virtual_stages, pp_rank, unit_numel)
    return [
        d.with_blocks([m if model.is_moe(i) else d for i in ranges[stage]])
        for d, m, stage in zip(dense, moe, chunk_stages)
    ]


def _one_block_units(
    model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int, unit_numel: int
) -> list[_ChunkUnits]:
    """`_classify` of one-block chunks (every block alike), memoized by what their structure
    depends on: the model less its depth, tp, each chunk's place (first / last)."""
    stages = pp * virtual_stages
    places = tuple((s == 0, s == stages - 1) for s in (stage_of(pp_rank, c, pp) for c in range(virtual_stages)))
    key = (*(v for k, v in vars(model).items() if k != "n_layers"), tp, places, unit_numel)
    if key not in _CHUNK_UNITS:
        _CHUNK_UNITS[key] = _classify(rank_chunks(model, tp, pp, virtual_stages, pp_rank), unit_numel)
    return _CHUNK_UNITS[key]


def unit_sizes(
    model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int, unit_numel: int = DEFAULT_UNIT_NUMEL
) -> list[Size]:
    """(numel, aligned numel) of the stage-3 units of pipeline rank `pp_rank`, which together
    hold all its parameters (`_chunk_units`)."""
    return [_size(u) for units in _chunk_units(model, tp, pp, virtual_stages, pp_rank, unit_numel) for u in units]


class Slot(NamedTuple):
    """A stretch of a pass that one collective of each data-parallel family serves: a stage-3
    unit that is gathered with the resident units forward uses after it, or a stages 0-2
    bucket. `numel`: its parameters; `gathered`: those all-gathered (the gathered unit's;
    a bucket's all, after the step); `gathers` / `reductions`: the collectives (one per
    bucket) that gather / reduce them; of those, the MoE experts' parameters."""

    numel: int
    gathered: int
    gathers: int
    reductions: int
    expert_numel: int = 0  # of `numel`, the MoE experts' (every expert: they have their own groups)
    expert_gathered: int = 0  # of `gathered`, the experts'


@dataclass(frozen=True)
class Pass:
    """A chunk's slots in the order forward uses them: each with its neighbours as ((slot
    before, slot, slot after), how many; None past an end), the first and last, and their
    sum (`total`)."""

    first: Slot
    last: Slot
    windows: tuple[tuple[tuple[Slot | None, Slot, Slot | None], int], ...]
    total: Slot

    @classmethod
    def of(cls, slots: list[Slot]) -> Pass:
        """The pass over `slots`, given in forward order."""
        neighbours = zip([None, *slots[:-1]], slots, [*slots[1:], None])
        return cls(slots[0], slots[-1], tuple(Counter(neighbours).items()), Slot(*map(sum, zip(*slots))))


def _unit_slots(units: list[Parts], resident: int) -> list[Slot]:
    """Each unit that stage 3 gathers (numel ≥ `resident`) with the resident units after it;
    the resident units before the first (all of them, when none is gathered) join the first."""
    slots: list[Slot] = []
    for unit in units:
        numel, buckets = _size(unit)[0], len(unit)
        experts = sum(n for key, (n, _) in unit.items() if key[-1])
        gathered = numel >= resident
        if not slots or (gathered and slots[-1].gathered):
            slots.append(Slot(0, 0, 0, 0))
        last = slots[-1]
        slots[-1] = Slot(
            last.numel + numel,
            last.gathered + numel * gathered,
            last.gathers + buckets * gathered,
            last.reductions + buckets,
            last.expert_numel + experts,
            last.expert_gathered + experts * gathered,
        )
    return slots


def _bucket_slots(units: list[Parts], bucket_numel: int) -> list[Slot]:
    """A chunk's buckets at stages 0-2: each bucket key's parameters in ⌈numel / bucket_numel⌉
    buckets of equal size (`optim.buffers.assign_buckets` packs whole parameters and caps
    the buckets completed last smaller: a few more); the vectors' first, as their buckets
    complete last in backward."""
    slots = []
    vectors_first = sorted(_merged(*((u, 1) for u in units)).items(), key=lambda part: part[0][0])
    for key, (numel, _) in vectors_first:
        count = -(-numel // bucket_numel)
        small, extra = divmod(numel, count)
        big, rest = small + 1, small
        slots += [Slot(big, big, 1, 1, *(big, big) if key[-1] else ())] * extra
        slots += [Slot(rest, rest, 1, 1, *(rest, rest) if key[-1] else ())] * (count - extra)
    return slots


@dataclass(frozen=True)
class RankParams:
    """The parameters of one rank of a pipeline rank, as ZeroOptimizer holds them. With MoE
    blocks and `ep` > 1 a rank holds 1/ep of the experts whole, while ZeRO still shards
    all of them over the shard group (each expert over the ranks holding it: N/ep)."""

    numel: int
    aligned: int  # each parameter aligned to ALIGN elements: what the buckets hold (every expert)
    held: int  # aligned numel this rank holds whole: the dense parameters and 1/ep of the experts
    resident: int  # held numel in stage-3 units below the resident size (kept whole)
    resident_volume: int  # aligned numel of those units (every expert)
    largest_units: int  # held numel of the two largest sharded stage-3 units (gathered at once)
    unit_passes: tuple[Pass, ...]  # stage 3: each chunk's units as slots
    bucket_passes: tuple[Pass, ...]  # stages 0-2: each chunk's gradient buckets as slots


_RANK_PARAMS: dict[tuple, RankParams] = {}


def rank_params(
    model: GPTConfig,
    tp: int,
    pp: int,
    virtual_stages: int,
    pp_rank: int,
    unit_numel: int = DEFAULT_UNIT_NUMEL,
    ep: int = 1,
) -> RankParams:
    """`RankParams` of pipeline rank `pp_rank`, experts split over `ep` ranks (memoized)."""
    key = (*vars(model).values(), tp, pp, virtual_stages, pp_rank, unit_numel, ep)
    if key not in _RANK_PARAMS:
        chunks = _chunk_units(model, tp, pp, virtual_stages, pp_rank, unit_numel)
        units = [(*_size(u), sum(a for k, (_, a) in u.items() if k[-1])) for c in chunks for u in c]
        resident = default_resident_numel(unit_numel)

        def held(aligned: int, experts: int) -> int:
            return aligned - experts + experts // ep

        whole = [(raw, a, e) for raw, a, e in units if raw < resident]
        sharded = sorted((held(a, e) for raw, a, e in units if raw >= resident), reverse=True)
        _RANK_PARAMS[key] = RankParams(
            numel=sum(raw for raw, _, _ in units),
            aligned=sum(a for _, a, _ in units),
            held=sum(held(a, e) for _, a, e in units),
            resident=sum(held(a, e) for _, a, e in whole),
            resident_volume=sum(a for _, a, _ in whole),
            largest_units=sum(sharded[:2]),
            unit_passes=tuple(Pass.of(_unit_slots(c, resident)) for c in chunks),
            bucket_passes=tuple(Pass.of(_bucket_slots(c, DEFAULT_BUCKET_NUMEL)) for c in chunks),
        )
    return _RANK_PARAMS[key]


def num_params(model: GPTConfig) -> int:
    """Trainable parameters of the tp = 1 model (padded vocabulary, tied head counted once,
    every expert of every MoE block), counted on the whole model built on the meta device."""
    with torch.device("meta"), _NoInit():
        whole = GPT(model, tp_group=ShapeGroup(1))  # tp = 1 even inside a distributed run
    return sum(p.numel() for p in dict.fromkeys(whole.parameters()) if p.requires_grad)


def active_params(model: GPTConfig) -> int:
    """The parameters one token's forward uses: all but the experts it is not routed to
    (each MoE block keeps its router, shared experts and k of its E experts)."""
    moe_blocks = sum(map(model.is_moe, range(model.n_layers)))
    per_expert = model.moe.d_ff * model.d_model * (3 if model.moe.swiglu else 2) if model.moe_experts else 0
    return num_params(model) - moe_blocks * (model.moe_experts - model.moe_top_k) * per_expert
