"""Flat parameter / gradient buckets and their data-parallel shards.

A bucket packs parameters of one param group into one flat 1-D buffer of `numel`
elements. Each parameter starts at a multiple of `ALIGN` elements and the total is
padded to a multiple of `N·ALIGN` (N = data-parallel size), so the buffer splits into
N equal shards; rank r owns elements [r·S/N, (r+1)·S/N).

    sharding (stage)           | full param buffer   | param shard        | fp32 master | grads (reduce dtype)
    ---------------------------+---------------------+--------------------+-------------+-----------------------------
    REPLICATED (0)             | persistent          | view of the buffer | covers S    | persistent full buffer
    SHARD_OPTIMIZER_STATE (1)  | persistent          | view of the buffer | covers S/N  | persistent full buffer
    SHARD_GRADIENTS (2)        | persistent          | view of the buffer | covers S/N  | full buffer only in backward
    SHARD_PARAMETERS (3)       | only while gathered | persistent S/N     | covers S/N  | full buffer only in backward

(`optim.sharding`.) The master is the param shard itself when params are fp32 (no copy).
A replicated bucket updates the whole buffer (`opt_range` = [0, S)); the others their own
shard.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from optim.sharding import Sharding
from parallel.marks import NO_MARKS, ParamMarks

ALIGN = 16  # elements; keeps every parameter view 64-byte aligned in fp32


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


class GradState(enum.Enum):
    """Where a bucket's gradient is between `zero_grad` and the step."""

    EMPTY = "no gradient since zero_grad"
    ACCUMULATING = "gradients added since its last reduction (or zero_grad), not reduced"
    REDUCING = "its reduction in flight"
    REDUCED = "the reduced sum in grad_shard (the full buffer's other regions stale)"


# The moves a bucket's gradient can make: accumulating (a backward's gradients), reducing
# (launched; also with no new gradient, at the end of a synced backward), reduced (retired),
# empty (zero_grad). A reduction in flight only finishes.
MOVES = {
    GradState.EMPTY: {GradState.EMPTY, GradState.ACCUMULATING, GradState.REDUCING},
    GradState.ACCUMULATING: {GradState.EMPTY, GradState.ACCUMULATING, GradState.REDUCING},
    GradState.REDUCING: {GradState.REDUCED},
    GradState.REDUCED: {GradState.EMPTY, GradState.ACCUMULATING, GradState.REDUCING},
}


@dataclass(eq=False)
class FlatBucket:
    """One flat bucket of parameters: layout, storage and shard views (see module docstring)."""

    params: list[torch.nn.Parameter]
    group_index: int
    sharding: Sharding
    rank: int
    world: int
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    offsets: list[int] = field(init=False)
    numel: int = field(init=False)
    param_buffer: torch.Tensor | None = field(init=False, default=None)
    param_shard: torch.Tensor = field(init=False)
    master: torch.Tensor = field(init=False)
    grad_buffer: torch.Tensor | None = field(init=False, default=None)
    grad_shard: torch.Tensor = field(init=False)
    grad_state: GradState = field(init=False, default=GradState.EMPTY)
    on_grad_bytes: Callable[[int], None] | None = None  # told +/- bytes of each transient full gradient buffer
    keeps_reduced_sum: bool = True  # False on all but the first replica (hybrid sharding): see the reduced-sum rule
    marks: ParamMarks = NO_MARKS  # the groups its parameters (all alike in these) are replicated and tied over
    group: object = None  # the data-parallel group it is sharded and reduced over (`rank`, `world` in it)
    replicate_group: object = None  # hybrid sharding: the ranks holding the same shard in other replicas

    def __post_init__(self) -> None:
        self.shapes = [p.shape for p in self.params]
        self.offsets, end = [], 0
        for p in self.params:
            self.offsets.append(end)
            end = _round_up(end + p.numel(), ALIGN)
        self.numel = _round_up(max(end, 1), self.world * ALIGN)
        self._written = [False] * len(self.params)
        self._slots: list[torch.Tensor] = []  # each parameter's view of grad_buffer, in its shape
        self.has_grad = [False] * len(self.params)  # parameter i has a gradient (torch: .grad is not None)

    def _move(self, to: GradState) -> None:
        if to not in MOVES[self.grad_state]:
            raise AssertionError(f"a gradient bucket cannot go from {self.grad_state.name} to {to.name}")
        self.grad_state = to

    # ---- layout -------------------------------------------------------------------------
    @property
    def dp_groups(self) -> list:
        """Its shard group, then its replicate group if any: every rank holding its parameters."""
        return [self.group] + ([self.replicate_group] if self.replicate_group is not None else [])

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world

    @property
    def shard_range(self) -> tuple[int, int]:
        """[lo, hi) of the flat buffer owned by this rank."""
        return self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel

    @property
    def opt_range(self) -> tuple[int, int]:
        """[lo, hi) of the flat buffer this rank's optimizer updates: all of it at stage 0."""
        return self.shard_range if self.sharding.optimizer_state else (0, self.numel)

    def ranges_of(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """Per parameter i overlapping flat [lo, hi): (i, start, end, at) where [start, end) is
        the range of the parameter's own flattening and `at` its offset inside [lo, hi)."""
        out = []
        for i, (shape, off) in enumerate(zip(self.shapes, self.offsets)):
            start, end = max(lo, off) - off, min(hi, off + shape.numel()) - off
            if start < end:
                out.append((i, start, end, off + start - lo))
        return out

    def shard_ranges(self, rank: int) -> list[tuple[int, int, int, int]]:
        """`ranges_of` for the shard that `rank` owns."""
        return self.ranges_of(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    # ---- storage ------------------------------------------------------------------------
    def allocate(self, flat_fp32: torch.Tensor) -> None:
        """Create the storage from the full flat fp32 values (identical on all ranks) and
        point each parameter at its view (or at an empty tensor at stage 3)."""
        lo, hi = self.shard_range
        full = flat_fp32.to(self.param_dtype)
        if self.sharding.parameters:
            self.param_shard = full[lo:hi].clone()
            self.release_params()
        else:
            self.param_buffer = full
            self.param_shard = full[lo:hi]
            self.bind_params(self.param_buffer)
        olo, ohi = self.opt_range
        if self.param_dtype == torch.float32:
            self.master = self.param_shard if self.sharding.optimizer_state else self.param_buffer
        else:
            self.master = flat_fp32[olo:ohi].clone()
        if not self.sharding.gradients:
            self._set_grad_buffer(torch.zeros(self.numel, dtype=self.reduce_dtype, device=flat_fp32.device))
            self.grad_shard = self.grad_buffer[olo:ohi]
        else:
            self.grad_shard = torch.zeros(self.shard_numel, dtype=self.reduce_dtype, device=flat_fp32.device)

    def bind_params(self, full: torch.Tensor) -> None:
        """Point every parameter's data at its view of the full flat buffer `full`."""
        for i, p in enumerate(self.params):
            p.data = self.param_view(full, i)

    def release_params(self) -> None:
        """Stage 3: drop the parameters' full data (their shapes stay in `shapes`)."""
        for p in self.params:
            p.data = torch.empty(0, dtype=self.param_dtype, device=self.param_shard.device)

    def param_view(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's view (original shape) of the full flat buffer `full`."""
        off = self.offsets[i]
        return full[off : off + self.shapes[i].numel()].view(self.shapes[i])

    def flat_values(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Pack `tensors` (one per parameter, in order) into a zero-padded flat buffer."""
        flat = torch.zeros(self.numel, dtype=dtype, device=tensors[0].device if tensors else None)
        for t, off in zip(tensors, self.offsets):
            flat[off : off + t.numel()].copy_(t.reshape(-1))
        return flat

    # ---- gradients ----------------------------------------------------------------------
    # Slots are written, not zeroed-then-added: the first gradient of a slot since the last
    # zero_grad / reduction is stored as scale·g, later ones are added, and slots no
    # gradient reached are zeroed only when the bucket is reduced. So zero_grad needs no
    # memset of the full buffer. Padding is zero from allocation and stays zero (reductions
    # of zeros). Reduced-sum rule: after a reduction this rank's own region already holds the
    # reduced sum A of earlier backwards; the other regions restart at zero, so the next
    # reduction yields A + Σ_ranks g exactly (each region is owned by one rank). With
    # replicas (hybrid sharding) a region is owned by one rank per replica, so only the
    # first replica keeps A (`keeps_reduced_sum`); the others restart at zero everywhere.
    def accumulate(self, i: int, grad: torch.Tensor, scale: float) -> None:
        """slot_i ← slot_i + scale·grad (or scale·grad for the slot's first gradient). Runs once
        per gradient in backward, so the buffer is prepared only when accumulation starts."""
        if self.grad_state is not GradState.ACCUMULATING:
            self._prepare_grad_buffer()
            self._move(GradState.ACCUMULATING)
        slot = self._slots[i]
        if self._written[i]:
            slot.add_(grad, alpha=scale)
        else:
            torch.mul(grad, scale, out=slot)
            self._written[i] = True
        self.has_grad[i] = True

    def param_slice(self, tensor: torch.Tensor, i: int, region: tuple[int, int]) -> tuple[int, torch.Tensor]:
        """Parameter i's part of the flat range `region` (`shard_range`: what this rank owns;
        `opt_range`: what its step updates) in `tensor`, which is laid out like `grad_shard`
        over `opt_range`: (where the part starts in the parameter's flattening, its view,
        empty when the range misses the parameter)."""
        off = self.offsets[i]
        start = min(max(region[0], off), off + self.shapes[i].numel())
        end = max(min(region[1], off + self.shapes[i].numel()), start)
        base = self.opt_range[0]
        return start - off, tensor[start - base : end - base]

    def clear_grad(self, i: int) -> None:
        """Zero parameter i's gradient wherever this rank holds it (its slot in the full buffer,
        its part of the shard); the other parameters keep theirs."""
        if self.grad_buffer is not None:
            self._slots[i].zero_()
        self.param_slice(self.grad_shard, i, self.opt_range)[1].zero_()

    def _prepare_grad_buffer(self) -> None:
        """The full buffer, ready for gradients to be added: allocated (stages 2-3), and after
        a reduction laid out by the reduced-sum rule (above)."""
        reduced = self.grad_state is GradState.REDUCED
        if self.grad_buffer is None:
            self._set_grad_buffer(torch.zeros(self.numel, dtype=self.reduce_dtype, device=self.grad_shard.device))
            self._grad_bytes_changed(+1)
            self._written = [False] * len(self.params)
            if reduced:
                lo, hi = self.shard_range
                if self.keeps_reduced_sum:
                    self.grad_buffer[lo:hi].copy_(self.grad_shard)
                self._written = [True] * len(self.params)
        elif reduced:
            lo, hi = self.shard_range if self.keeps_reduced_sum else (self.numel, self.numel)
            self.grad_buffer[:lo].zero_()
            self.grad_buffer[hi:].zero_()
            self._written = [True] * len(self.params)

    def grads_for_reduction(self) -> torch.Tensor:
        """The full gradient buffer with every slot valid (unwritten slots zeroed), handed to
        its reduction."""
        self._prepare_grad_buffer()
        self._move(GradState.REDUCING)
        for i, written in enumerate(self._written):
            if not written:
                self._slots[i].zero_()
        self._written = [True] * len(self.params)
        return self.grad_buffer

    def after_reduction(self) -> None:
        """The reduced sum now lives in `grad_shard`; stages 2-3 drop the full buffer."""
        if self.sharding.gradients:
            self._drop_grad_buffer()
        self._move(GradState.REDUCED)

    def zero_grad(self) -> None:
        """Forget the gradients: stages 0-1 only mark their slots unwritten (see above)."""
        if self.sharding.gradients:
            self.grad_shard.zero_()
            self._drop_grad_buffer()
        self._written = [False] * len(self.params)
        self.has_grad = [False] * len(self.params)
        self._move(GradState.EMPTY)

    def _drop_grad_buffer(self) -> None:
        if self.grad_buffer is not None:
            self._grad_bytes_changed(-1)
            self._set_grad_buffer(None)

    def _set_grad_buffer(self, buffer: torch.Tensor | None) -> None:
        """The full gradient buffer and each parameter's slot in it (none with the buffer, whose
        views would otherwise keep it alive)."""
        self.grad_buffer = buffer
        self._slots = [] if buffer is None else [self.param_view(buffer, i) for i in range(len(self.params))]

    def _grad_bytes_changed(self, sign: int) -> None:
        """Stages 2-3 allocate the full gradient buffer per reduction; report its bytes."""
        if self.on_grad_bytes is not None:
            self.on_grad_bytes(sign * self.numel * self.grad_buffer.element_size())

    def zero_if_never_reduced(self) -> None:
        """With no backward since zero_grad the gradient is zero (stages 0-1 zero lazily)."""
        if self.grad_state is GradState.EMPTY and not self.sharding.gradients:
            self.grad_shard.zero_()

    # ---- parameters after the step --------------------------------------------------------
    @property
    def opt_param(self) -> torch.Tensor:
        """The low-precision parameter region the optimizer updates (full buffer at stage 0)."""
        return self.param_shard if self.sharding.optimizer_state else self.param_buffer

    def write_master_to_params(self) -> None:
        """Copy the updated fp32 master into the low-precision params (no-op when they alias)."""
        if self.master.data_ptr() != self.opt_param.data_ptr():
            self.opt_param.copy_(self.master)


def bucket_key(group: object, root: int | None, marks: ParamMarks) -> tuple:
    """What the parameters of one bucket share: the param group, the root module (a pipeline
    rank's chunk), the groups they are replicated and tied over, and for experts their
    data-parallel groups."""
    expert = (id(marks.expert.shard), id(marks.expert.replicate)) if marks.expert is not None else None
    return group, root, tuple(map(id, marks.replicated)), tuple(map(id, marks.tied)), expert


def assign_buckets(
    params: list[torch.nn.Parameter],
    key: Callable[[torch.nn.Parameter], object],
    bucket_numel: float,
    last_numel: float | None = None,
) -> list[list[torch.nn.Parameter]]:
    """Split `params` (in the order their gradients arrive) by `key(p)`, pack each part
    greedily from its last parameter back into buckets whose caps double from last_numel
    (default bucket_numel) up to bucket_numel, and order the buckets by their last
    parameter: the order in which buckets complete (so a part spread over the whole model,
    such as the norms of a no-decay group, goes last instead of holding back every bucket
    launched after it). A bucket closes when the next parameter would pass its cap, but
    only once it is at least half full: under half, it takes that parameter whatever its
    size, and a leftover under half its cap joins the bucket after it, so no collective is
    spent on a sliver (on a CPU each one costs about as much as megabytes of reduction).

    The doubling tail: the bucket completed last is reduced with no backward left to hide
    it, the one before with only the last one's backward, and so on; a cap of
    last_numel·2^k for the k-th bucket from the end keeps what is left to reduce when
    backward ends under ~2·last_numel, where one full bucket completing just before the end
    would leave all of it exposed."""
    last_arrival = arrival_key({p: i for i, p in enumerate(params)})
    parts: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        parts.setdefault(key(p), []).append(p)
    buckets: list[list[torch.nn.Parameter]] = []
    for part in parts.values():
        caps = tail_caps(bucket_numel, last_numel)
        cap = next(caps)
        packed, current, size = [], [], 0  # latest to arrive first
        for p in reversed(part):
            if current and 2 * size >= cap and size + p.numel() > cap:
                packed.append(current)
                current, size, cap = [], 0, next(caps)
            current.append(p)
            size += p.numel()
        if packed and 2 * size < cap:
            packed[-1] += current  # a leftover under half its cap joins its neighbour
        else:
            packed.append(current)
        buckets += [b[::-1] for b in packed]
    return sorted(buckets, key=last_arrival)


def tail_caps(bucket_numel: float, last_numel: float | None = None) -> Iterator[float]:
    """The bucket caps from the bucket completed last backwards: last_numel (default
    bucket_numel; at least 1), doubling up to bucket_numel, then bucket_numel for ever."""
    cap = bucket_numel if last_numel is None else min(max(last_numel, 1), bucket_numel)
    while True:
        yield cap
        cap = min(2 * cap, bucket_numel)


def arrival_key(position: dict[torch.nn.Parameter, int]) -> Callable[[list[torch.nn.Parameter]], int]:
    """Sort key of a bucket's parameters: the arrival position of its last gradient."""
    return lambda params: max(position[p] for p in params)
