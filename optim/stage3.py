"""ZeRO stage 3: parameters live as 1/N shards and are gathered per module when needed.

Units. Walking the module tree in post-order, a module claims the trainable parameters
of its subtree that no descendant claimed once they add up to `unit_numel` elements
(the root claims the rest): for a GPT this gives one unit per transformer block when
`unit_numel` is below a block's size. Containers without a forward (ModuleList,
ModuleDict) never claim, since nothing would gather for them; when the model itself is
one (a pipeline rank's chunks), each called child is a root. A unit's buckets are all-gathered just before the
forward of its module and again before its backward, and freed after each.

Foreign users. A module that holds a parameter claimed by a unit that is neither itself
nor an ancestor (a tied output head using the embedding's weight) gathers that unit
around its own forward and backward as well.

Quantized gathering (ZeRO++ qwZ, Wang et al. 2023). With `qwz_block`, each rank sends its
shard as int8 with one fp32 scale per block (`optim.quantize`) and the unit is dequantized
on arrival: the compute copy of the parameters carries at most max|block|/254 of error per
element, while the fp32 masters, the update and every checkpoint stay exact.

Secondary partition (ZeRO++ hpZ, Wang et al. 2023). With an `hpz_group` (the k ranks of
the shard group on this node), the first gather of a unit in a step leaves each rank a 1/k
slice of it (the values forward used, dequantized under qwZ), kept until the parameters
change at the next step; every later gather of the unit in the step (backward, the next
micro-batches) all-gathers those slices inside the node instead of the shards across
nodes, for 2Ψ/k more bytes per rank (bf16).

Ranks in step. Every rank must gather the same units in the same order, and a rank that
skips a forward (an evaluation on rank 0 only) would otherwise have its gathers matched with
another rank's gathers of other units. So each root forward first checks in on a side group
(`check_in`: every rank says whether it runs a training forward or one without gradients,
and how many check-ins it made): ranks that differ raise on every rank, naming what each is
in, before any parameter moves; a rank that never arrives leaves the others waiting for the
collective watchdog (`parallel.desync.watch`), which names it.

Prefetch. The order in which units were first gathered in the previous forward and the
previous backward is recorded; the first gather of unit u in a pass also starts the
asynchronous gather of the unit that followed u last time. If the order changed, the prefetched unit is freed
unused at the end of the pass: ranks still agree, since they share the same history.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from optim.buffers import FlatBucket
from optim.collectives import ShardGather, all_gather_shards
from optim.quantize import QuantizedGather
from parallel import comm, flight

# what a rank checks in for (`check_in`), as the sentence names it
TRAINING_FORWARD, EVAL_FORWARD, MODEL_STATE_DICT = range(1, 4)
CHECK_INS = {
    TRAINING_FORWARD: "a training forward",
    EVAL_FORWARD: "a forward without gradients (an evaluation)",
    MODEL_STATE_DICT: "model.state_dict()",
}
OUT_OF_STEP = (
    "at ZeRO stage 3 every rank must run the same forwards and model state-dict calls in the same order, since "
    "each gathers parameters from all of them, but {who}: evaluate and call model.state_dict() on every rank, "
    "or save on one rank from opt.full_state_dict() (a collective) or with torch.distributed.checkpoint"
)


def check_in(side: dist.ProcessGroup, what: int, count: int) -> None:
    """Every rank of `side` says what it is about to do (a key of CHECK_INS) and how many
    check-ins it made before; if they differ, raise OUT_OF_STEP on every rank."""
    world = dist.get_world_size(side)
    everyone = torch.empty(2 * world, dtype=torch.int64, device="cpu")  # `side` is a gloo group (host memory)
    with flight.doing(f"the stage-3 check-in of {CHECK_INS[what]}"):
        comm.all_gather_into_tensor(everyone, torch.tensor([what, count], device="cpu"), group=side)
    said = [tuple(pair) for pair in everyone.view(world, 2).tolist()]
    if len(set(said)) > 1:
        who = "; ".join(
            f"rank {dist.get_global_rank(side, r)} is in {CHECK_INS.get(w, '?')}, its check-in #{n + 1}"
            for r, (w, n) in enumerate(said)
        )
        raise RuntimeError(OUT_OF_STEP.format(who=who))


def has_own_forward(module: torch.nn.Module) -> bool:
    """Whether the module has a forward of its own (containers such as ModuleList do not,
    so hooks on them never fire and they cannot gather anything)."""
    return type(module).forward is not torch.nn.Module.forward


def root_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost modules that are called: the model, or the children of a container
    (e.g. the chunks of a pipeline rank held in a ModuleList)."""
    return [model] if has_own_forward(model) else [r for child in model.children() for r in root_modules(child)]


def stage3_units(
    model: torch.nn.Module, trainable: set[torch.nn.Parameter], unit_numel: int
) -> list[tuple[torch.nn.Module, list[torch.nn.Parameter]]]:
    """(module, claimed params) per unit, in post-order (see module docstring)."""
    units: list[tuple[torch.nn.Module, list[torch.nn.Parameter]]] = []
    seen: set[torch.nn.Parameter] = set()
    top = {id(r) for r in root_modules(model)}

    def visit(module: torch.nn.Module) -> list[torch.nn.Parameter]:
        pending = [q for child in module.children() for q in visit(child)]
        for p in module.parameters(recurse=False):
            if p in trainable and p not in seen:
                seen.add(p)
                pending.append(p)
        enough = id(module) in top or sum(p.numel() for p in pending) >= unit_numel
        if pending and has_own_forward(module) and enough:
            units.append((module, pending))
            return []
        return pending

    leftover = visit(model)
    if leftover:
        raise ValueError(
            "stage 3 found trainable parameters held only by modules that are never called; "
            "put them in a module with a forward"
        )
    return units


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass(eq=False)
class Unit:
    """The buckets gathered and freed together, and their gather state."""

    buckets: list[FlatBucket]
    full: list[torch.Tensor] | None = None
    gathers: list[ShardGather] = field(default_factory=list)  # in flight, one per bucket
    secondary: list[torch.Tensor] | None = None  # hpZ: this rank's 1/k slice of each bucket
    users: int = 0
    buckets_done: int = 0


class ParamGatherer:
    """Forward / backward hooks that gather and free stage-3 units (see module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        units: list[tuple[torch.nn.Module, list[FlatBucket]]],
        group: dist.ProcessGroup | None,
        qwz: QuantizedGather | None = None,
        hpz_group: dist.ProcessGroup | None = None,
        side: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.side, self.check_ins = side, 0  # `check_in` (None: one rank)
        self.qwz = qwz
        self.hpz_group = hpz_group
        self.units = [Unit(buckets) for _, buckets in units]
        self._bucket_unit = {id(b): u for u, (_, bs) in zip(self.units, units) for b in bs}
        self._order: dict[str, list[Unit]] = {"forward": [], "backward": []}
        self._next: dict[str, dict[Unit, Unit]] = {"forward": {}, "backward": {}}
        for r in root_modules(model):
            r.register_forward_pre_hook(self._on_root_forward)
        for module, needed in self._users(model, units).items():
            module.register_forward_pre_hook(lambda m, a, needed=needed: self._pre_forward(needed))
            module.register_forward_hook(lambda m, a, out, needed=needed: self._post_forward(needed, out))
        for r in root_modules(model):
            r.register_forward_hook(lambda m, a, out: self._reshard_idle())

    def _users(self, model: torch.nn.Module, units: list[tuple[torch.nn.Module, list[FlatBucket]]]) -> dict:
        """module -> units it must have gathered around its forward and backward: its own
        unit, plus the units of directly held parameters claimed outside its ancestry."""
        owner = {p: (u, m) for u, (m, bs) in zip(self.units, units) for b in bs for p in b.params}
        needs: dict[torch.nn.Module, list[Unit]] = {m: [u] for u, (m, _) in zip(self.units, units)}

        def visit(module: torch.nn.Module, lineage: set[int]) -> None:
            lineage = lineage | {id(module)}
            for p in module.parameters(recurse=False):
                unit, unit_module = owner.get(p, (None, None))
                if unit is not None and id(unit_module) not in lineage and unit not in needs.get(module, []):
                    needs.setdefault(module, []).append(unit)
            for child in module.children():
                visit(child, lineage)

        visit(model, set())
        return needs

    # ---- gather / free ------------------------------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        if unit.full is not None:
            return
        unit.full = [torch.empty(b.numel, dtype=b.param_dtype, device=b.param_shard.device) for b in unit.buckets]
        if unit.secondary is not None:
            unit.gathers = [
                all_gather_shards(full, slice_, self.hpz_group) for full, slice_ in zip(unit.full, unit.secondary)
            ]
        else:
            unit.gathers = [
                all_gather_shards(full, b.param_shard, b.group, self.qwz) for full, b in zip(unit.full, unit.buckets)
            ]

    def _unshard(self, unit: Unit, phase: str) -> None:
        """Gather `unit` now (waiting for a prefetch in flight) and prefetch its successor."""
        order = self._order[phase]
        first_use = unit not in order
        if first_use:
            order.append(unit)
        without_grad = " without gradients" if phase == "forward" and not torch.is_grad_enabled() else ""
        with flight.doing(f"a stage-3 parameter gather inside {phase}{without_grad}"):
            self._unshard_now(unit, phase, first_use)

    def _unshard_now(self, unit: Unit, phase: str, first_use: bool) -> None:
        self._start_gather(unit)
        if unit.gathers:
            for gather in unit.gathers:
                gather.finish()
            for b, full in zip(unit.buckets, unit.full):
                b.bind_params(full)
            unit.gathers = []
        following = self._next[phase].get(unit) if first_use else None
        if following is not None:
            self._start_gather(following)

    def _reshard(self, unit: Unit) -> None:
        if unit.full is None:
            return
        if self.hpz_group is not None and unit.secondary is None and not unit.gathers:
            k, j = dist.get_world_size(self.hpz_group), dist.get_rank(self.hpz_group)
            unit.secondary = [full.chunk(k)[j].clone() for full in unit.full]
        for gather in unit.gathers:
            gather.wait()
        for b in unit.buckets:
            b.release_params()
        unit.full, unit.gathers = None, []

    @torch.compiler.disable
    def _reshard_idle(self) -> None:
        """End of the root forward: free units gathered but not in use (unused prefetches)."""
        if not _in_backward():
            for unit in self.units:
                if unit.users == 0:
                    self._reshard(unit)

    # ---- hooks --------------------------------------------------------------------------
    @torch.compiler.disable
    def _on_root_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if not _in_backward():
            self.check_in(TRAINING_FORWARD if torch.is_grad_enabled() else EVAL_FORWARD)
            self._finish_pass("forward")

    def check_in(self, what: int) -> None:
        """`check_in` on the side group (nothing on one rank)."""
        if self.side is not None:
            check_in(self.side, what, self.check_ins)
            self.check_ins += 1

    @torch.compiler.disable
    def _pre_forward(self, needed: list[Unit]) -> None:
        for unit in needed:
            unit.users += 1
            self._unshard(unit, "backward" if _in_backward() else "forward")

    @torch.compiler.disable
    def _post_forward(self, needed: list[Unit], output: object) -> None:
        for unit in needed:
            unit.users -= 1
            if unit.users == 0 and not _in_backward():
                self._reshard(unit)
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors and torch.is_grad_enabled():
            register_multi_grad_hook(tensors, lambda grads: self._pre_backward(needed), mode="any")

    def _pre_backward(self, needed: list[Unit]) -> None:
        for unit in needed:
            self._unshard(unit, "backward")

    def bucket_done(self, bucket: FlatBucket) -> None:
        """All gradients of `bucket` are in: free its unit once all its buckets are done."""
        unit = self._bucket_unit.get(id(bucket))
        if unit is None:
            return
        unit.buckets_done += 1
        if unit.buckets_done == len(unit.buckets):
            unit.buckets_done = 0
            self._reshard(unit)

    def backward_end(self) -> None:
        """Free everything still gathered and keep this backward's order for prefetching."""
        for unit in self.units:
            unit.buckets_done = 0
            if unit.users == 0:
                self._reshard(unit)
        self._finish_pass("backward")

    def _finish_pass(self, phase: str) -> None:
        order = self._order[phase]
        if order:
            self._next[phase] = dict(itertools.pairwise(order))
            self._order[phase] = []

    def forget_secondary(self) -> None:
        """The parameters changed (a step, a loaded checkpoint): hpZ's slices are stale."""
        for unit in self.units:
            unit.secondary = None

    def secondaries(self) -> list[torch.Tensor]:
        return [t for unit in self.units for t in unit.secondary or []]
