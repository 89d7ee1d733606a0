"""Gradient accumulation into flat buckets and their reduction over the data-parallel group.

Each parameter's gradient, as soon as autograd has accumulated it, is added into its
bucket's slot scaled by 1/N and freed, so the reduction SUM yields the DDP average
ḡ = (1/N) Σ_r g_r. `param.grad` then holds the parameter's `GradPlaceholder`
(optim.grad_placeholder): a further backward adds into it, which hands the new gradient
to the hook; a `.grad` found plain again (None, then autograd's fresh tensor) means the
user cleared it (`model.zero_grad()`), so the slot restarts from zero as torch's would. A bucket whose gradients are all in is reduced asynchronously —
all-reduce at stage 0, reduce-scatter at stages 1-3 — while backward goes on. Buckets
are launched strictly in bucket order, which every rank shares, so ranks whose autograd
finishes buckets in a different order still issue the same collectives in the same order.
At the end of backward the remaining buckets (whose parameters got no gradient this time)
are launched too and every reduction is waited for, except inside `overlapped()`: there a
backward returns with its reductions in flight (a pipeline stage sends its input gradient
upstream meanwhile), and leaving the context waits for them. A gradient arriving for a bucket
whose reduction is still in flight first waits for that reduction (it reads and may reuse
the bucket's buffer).

Scoped backward (`only(indices)`): the caller promises that the backward produces gradients
only for the parameters of those buckets (a pipeline chunk's backward, on every rank alike),
so only they are launched, in their order, and the other buckets keep what they hold. This
is how gradients are reduced every micro-batch without reducing every chunk's buckets each time.

Hybrid sharding (`replicate_group`): the group is one replica's shard group; each
reduction there is followed by an all-reduce, across the replicas, of the part this rank
keeps (its shard; the whole buffer at stage 0), so ḡ = (1/(N·R)) Σ over all N·R ranks.
ZeRO++ qgZ (`QuantizedReduction`, stages 2-3): the reduce-scatter becomes quantized
all-to-alls inside the node and then across nodes (`optim.quantize`) into a fresh shard,
which is then added to the gradients the shard already holds (no reduced sum kept in the buffer,
so earlier reductions of the step are never quantized again).

A reduction is retired (`FlatBucket.after_reduction`: stages 2-3 free the full bucket) as
soon as it has completed, checked whenever a bucket is launched. Stages 2-3 keep at most
`MAX_IN_FLIGHT` reductions unretired: launching one more first waits for the oldest, so during
backward a stage-2 rank holds its shards plus a few full buckets, not all of them. Stages 0-1
keep their full buckets anyway, so their backward never waits for a reduction (on a slow
link such a wait would hold back the rest of backward, and a pipeline stage's send upstream).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from optim.buffers import FlatBucket
from optim.quantize import reduce_scatter_quantized
from parallel import comm, flight

if TYPE_CHECKING:
    from optim.grad_tracker import GradTracker
    from optim.stage3 import ParamGatherer
    from optim.zero_state import ZeroState

MAX_IN_FLIGHT = 2
QGZ_BLOCK = 2048  # elements per quantization block of qgZ


@dataclass(frozen=True)
class QuantizedReduction:
    """qgZ's bits, and the shard group as node group (intra) × cross-node group (inter)."""

    bits: int
    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None


def _on_grad(reducer: weakref.ref[GradReducer], b: int, i: int, param: torch.Tensor) -> None:
    """A parameter's post-accumulate-grad hook: its reducer's, while the reducer lives."""
    live = reducer()
    if live is not None:
        live.on_grad(b, i, param)


class GradReducer:
    """Hooks that accumulate and reduce gradients bucket by bucket (see module docstring), and
    the one owner of a backward's events: at its first gradient (parameter i of bucket b, whose
    `.grad` autograd has just set, before it is added) the tracker forgets the gradients whose
    `.grad` the user cleared (`GradTracker.check_grads`); once all parameters of a bucket have
    their gradient, stage 3 frees its unit (`ParamGatherer.bucket_done`); at its end, after the
    reductions, stage 3 frees what it gathered and then the tracker agrees on which parameters
    got a gradient (`_end_of_backward`). The model's `require_backward_grad_sync` (DDP's flag,
    which training scripts set on micro-steps), read at the first gradient of each backward,
    False makes that backward accumulate only, as inside `no_sync()`.
    """

    def __init__(
        self,
        state: ZeroState,
        tracker: GradTracker,
        gatherer: ParamGatherer | None,
        quantized: QuantizedReduction | None = None,
    ) -> None:
        self.shared, self.tracker, self.gatherer, self.quantized = state, tracker, gatherer, quantized
        buckets = state.buckets
        self.sync = True  # False inside no_sync()
        self._syncing = True  # whether the backward in progress reduces
        self._scope = list(range(len(buckets)))  # the buckets a synced backward launches, in order
        self._in_scope = set(self._scope)
        replicas = dist.get_world_size(state.replicate_group) if state.replicate_group is not None else 1
        self._scale = 1.0 / (state.world * replicas)  # the mean over every data-parallel rank
        self._ready = [0] * len(buckets)
        self._next = 0
        # reductions in flight: (their collectives in order, the works of the current one, bucket)
        self._works: list[tuple[Iterator[list[dist.Work | None]], list[dist.Work | None], FlatBucket]] = []
        self._callback_queued = False
        self._wait_at_end = True  # False inside overlapped()
        # The parameters hold their hooks where Python's garbage collector cannot follow
        # (autograd's C++ side), so a hook that held this reducer would keep it, its buckets and
        # the whole optimizer alive for as long as the model lives: the hooks hold it weakly.
        me = weakref.ref(self)
        for b, bucket in enumerate(buckets):
            for i, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(partial(_on_grad, me, b, i))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate locally; the next synced backward reduces."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    @contextlib.contextmanager
    def only(self, indices: list[int]) -> Iterator[None]:
        """Synced backward passes inside reduce only the buckets `indices` (see module docstring)."""
        previous = self._scope
        self._scope = sorted(indices)
        self._in_scope = set(self._scope)
        try:
            yield
        finally:
            self._scope = previous
            self._in_scope = set(previous)

    @contextlib.contextmanager
    def overlapped(self) -> Iterator[None]:
        """Synced backward passes inside return without waiting for their reductions; leaving
        the context (without an error) waits for every one."""
        previous, self._wait_at_end = self._wait_at_end, False
        try:
            yield
        finally:
            self._wait_at_end = previous
        self._retire(keep=0)

    @property
    def buckets(self) -> list[FlatBucket]:
        return self.shared.buckets

    def on_grad(self, b: int, i: int, param: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self._syncing = self.sync and getattr(self.shared.model, "require_backward_grad_sync", True)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.tracker.check_grads(arriving=(b, i))
        bucket = self.buckets[b]
        if self._ready[b] == 0:
            self._finish_reduction_of(bucket)
        grad, placeholder = param.grad, self.tracker.placeholders[b][i]
        if grad is placeholder:
            grad = grad.take()
        elif bucket.has_grad[i]:
            bucket.clear_grad(i)
        bucket.accumulate(i, grad, self._scale)
        param.grad = placeholder
        self._ready[b] += 1
        if self._syncing and b not in self._in_scope:
            raise RuntimeError(
                f"parameter {i} of gradient bucket {b} got a gradient in a backward scoped to other buckets; "
                "scope the backward to every module whose parameters it reaches"
            )
        if self._ready[b] == len(bucket.params):
            if self.gatherer is not None:
                self.gatherer.bucket_done(bucket)
            if self._syncing:
                self._launch_in_order()

    def _launch_in_order(self, everything: bool = False) -> None:
        """Launch the scope's buckets from `_next` on while they are complete (all: `everything`)."""
        while self._next < len(self._scope):
            b = self._scope[self._next]
            if not everything and self._ready[b] < len(self.buckets[b].params):
                return
            self._launch(self.buckets[b])
            self._next += 1

    def _retire(self, keep: int) -> None:
        """Retire finished reductions in launch order; wait while more than `keep` remain."""
        while self._works:
            steps, works, bucket = self._works[0]
            busy = any(w is not None and not w.is_completed() for w in works)
            if busy and len(self._works) <= keep:
                return
            for w in works:
                if w is not None:
                    w.wait()
            following = next(steps, None)
            if following is not None:
                self._works[0] = (steps, following, bucket)
                continue
            bucket.after_reduction()
            self._works.pop(0)

    def _finish_reduction_of(self, bucket: FlatBucket) -> None:
        """Wait until `bucket` has no reduction in flight (retiring those launched before it)."""
        while any(entry[2] is bucket for entry in self._works):
            self._retire(keep=len(self._works) - 1)

    def _launch(self, bucket: FlatBucket) -> None:
        self._retire(keep=MAX_IN_FLIGHT - 1 if bucket.sharding.gradients else len(self._works))
        steps = self._reduction(bucket)
        with flight.doing("a gradient reduction inside backward"):
            self._works.append((steps, next(steps), bucket))

    def _reduction(self, bucket: FlatBucket) -> Iterator[list[dist.Work | None]]:
        """The collectives of one bucket's reduction, each yielded once issued: all-reduce
        (stage 0), reduce-scatter or qgZ's all-to-alls (1-3), then the all-reduce across replicas."""
        full = bucket.grads_for_reduction()
        if not bucket.sharding.optimizer_state:
            out = full
            yield [comm.all_reduce(full, group=bucket.group, async_op=True)]
        elif self.quantized is not None and bucket.sharding.gradients:
            q = self.quantized
            out = torch.empty_like(bucket.grad_shard)
            yield from reduce_scatter_quantized(full, out, q.intra, q.inter, q.bits, QGZ_BLOCK)
        else:
            lo, hi = bucket.shard_range
            out = bucket.grad_shard if bucket.sharding.gradients else full[lo:hi]
            # the full buffer is not read after its reduction (optim.buffers' reduced-sum rule)
            yield [comm.reduce_scatter_tensor(out, full, group=bucket.group, async_op=True, reuse_input=True)]
        if bucket.replicate_group is not None:
            yield [comm.all_reduce(out, group=bucket.replicate_group, async_op=True)]
        if out is not bucket.grad_shard and bucket.sharding.gradients:
            bucket.grad_shard.add_(out)

    def _end_of_backward(self) -> None:
        """Autograd's callback at the end of a backward: the rest of a synced backward's buckets
        are launched (and waited for, outside `overlapped()`), stage 3 frees what it gathered,
        then the tracker learns whether every bucket was reduced."""
        self._callback_queued = False
        if self._syncing:
            self._launch_in_order(everything=True)
            if self._wait_at_end:
                self._retire(keep=0)
            self._next = 0
        self._ready = [0] * len(self.buckets)
        if self.gatherer is not None:
            self.gatherer.backward_end()
        self.tracker.backward_end(self._syncing and len(self._scope) == len(self.buckets))
