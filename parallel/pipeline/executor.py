"""Runs one rank's schedule actions over its model chunks.

One `run` is one optimizer step's worth of pipeline work: m micro-batches through all
virtual stages. Forward of (micro-batch i, chunk c) feeds the chunk the token ids (first
virtual stage) or the activations received from the previous stage (as a leaf that
requires grad); the last virtual stage returns the micro-batch loss, and its backward
starts from optimizer.scale_loss(loss_i / m) (an fp16 loss scale), so the gradients are
those of the mean loss over micro-batches.
Every other backward starts from its output with the gradient received from the next
stage, and sends its input's gradient back; a chunk's MoE auxiliary losses ride on that
output (`parallel.expert.aux_loss`), back-propagated × scale_loss(1/m) like the loss.

Communication: each run of consecutive SEND / RECV actions becomes one
`batch_isend_irecv`; sends are never waited for before the end of the step and a receive
only right before the compute that consumes it, so no legal schedule can deadlock.
Activations and gradients use different tags, so two message kinds on one rank pair
never mix. A peer equal to this rank (pp = 1 with v > 1) is a local hand-off.
Once an output's send has completed its storage is freed (Megatron's "deallocate output
tensor"): backward starts from the output's gradient edge and never reads its values.
The executor talks to the optimizer through one small protocol, `ReductionControl`
(`optim.ZeroOptimizer` is one; docs/architecture.md maps the hooks each call arms).
Gradient reduction over data parallelism, two policies (`grad_sync`). "last": every backward
but the rank's last runs under `no_sync()`, so reduction starts when the rank's last backward
runs. "every": every backward of a (micro-batch, chunk) runs under `sync_only(chunk)` and
reduces that chunk's gradients. The whole step runs under `overlapped_reductions()`: a
backward returns with its reductions in flight, so the input gradient it sends upstream does
not wait for them (else every stage's reduction would lie on the critical path of the
stages before it); the step's end waits for them.
Zero-bubble schedules split backward into B (input gradient only, sent upstream at once)
and W (weight gradients only), see `parallel.pipeline.split_backward`.
Per compute action the executor records (rank, kind, micro-batch, chunk, start, end) in
`events`, the format `parallel.pipeline.timeline` draws.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from contextlib import AbstractContextManager
from typing import Literal, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from parallel import comm
from parallel.expert import aux_loss
from parallel.pipeline.schedules import COMM, Action, rank_chunk_of, schedule, splits_backward, stage_of, validate
from parallel.pipeline.split_backward import backward_input

TAGS = {"F": 0, "B": 1}


class ReductionControl(Protocol):
    """What the executor needs from an optimizer, and nothing more."""

    def no_sync(self) -> AbstractContextManager:
        """Backward passes inside accumulate gradients without data-parallel reduction."""

    def sync_only(self, module: nn.Module) -> AbstractContextManager:
        """Backward passes inside reduce only `module`'s gradients."""

    def overlapped_reductions(self) -> AbstractContextManager:
        """Synced backward passes inside return with their reductions in flight; leaving waits."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss × the fp16 loss scale (loss itself otherwise)."""


class LocalGradients:
    """The `ReductionControl` of a pipeline without a data-parallel optimizer: no reduction to
    defer or scope, no loss scale."""

    def no_sync(self) -> AbstractContextManager:
        return contextlib.nullcontext()

    def sync_only(self, module: nn.Module) -> AbstractContextManager:
        return contextlib.nullcontext()

    def overlapped_reductions(self) -> AbstractContextManager:
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


@dataclasses.dataclass
class _StepState:
    """Everything one `run` creates and consumes; a fresh one per step. Keys are
    (micro-batch, chunk), or (kind, micro-batch, chunk) for received tensors."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    x: dict = dataclasses.field(default_factory=dict)  # a chunk's input leaf (stage > 0)
    out: dict = dataclasses.field(default_factory=dict)  # a chunk's output, until its backward
    pending: dict = dataclasses.field(default_factory=dict)  # receives in flight: (buffer, works)
    local: dict = dataclasses.field(default_factory=dict)  # hand-offs between chunks of this rank
    sends: list = dataclasses.field(default_factory=list)  # send works, waited at the end
    to_free: list = dataclasses.field(default_factory=list)  # (sent output, its works)
    losses: list = dataclasses.field(default_factory=list)  # last stage: detached micro-batch losses
    weight_work: dict = dataclasses.field(default_factory=dict)  # zero-bubble: W left by each B


class PipelineExecutor:
    """Executes `schedule(name, pp, rank, microbatches, len(chunks))` on `chunks` (this
    rank's model chunks, chunk c holding virtual stage c·pp + rank), reducing gradients
    through `optimizer` with the `grad_sync` policy."""

    def __init__(
        self,
        chunks: list[nn.Module],
        schedule_name: str,
        microbatches: int,
        pp_group: dist.ProcessGroup | None = None,
        optimizer: ReductionControl | None = None,
        grad_sync: Literal["last", "every"] = "last",
    ) -> None:
        if grad_sync not in ("last", "every"):
            raise ValueError(f"grad_sync={grad_sync!r} is not one of 'last', 'every'")
        self.chunks, self.m = chunks, microbatches
        self.group = pp_group
        self.pp, self.rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        validate(schedule_name, self.pp, microbatches, len(chunks))
        self.actions = schedule(schedule_name, self.pp, self.rank, microbatches, len(chunks))
        self.split = splits_backward(schedule_name)
        self.optimizer = optimizer or LocalGradients()
        self.grad_sync = grad_sync
        weight_grads = [i for i, a in enumerate(self.actions) if a.kind == ("W" if self.split else "B")]
        self._last_weight_grad = weight_grads[-1] if weight_grads else -1
        self.n_stages = self.pp * len(chunks)
        self.device = _device_of(chunks)
        self.events: list[tuple[int, str, int, int, float, float]] = []

    def run(
        self,
        inputs: list[torch.Tensor],
        targets: list[torch.Tensor],
        activation_shape: tuple[int, ...],
        activation_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor | None:
        """One step over the m micro-batches (`inputs[i]`, `targets[i]`; only the ranks
        holding the first / last virtual stage read them). Returns the mean loss over
        micro-batches on the rank holding the last stage, None elsewhere."""
        self.events = []
        self._s = _StepState(inputs, targets, activation_shape, activation_dtype)
        with self.optimizer.overlapped_reductions():
            i = 0
            while i < len(self.actions):
                j = i
                while j < len(self.actions) and self.actions[j].kind in COMM:
                    j += 1
                if j > i:
                    self._communicate(self.actions[i:j])
                    i = j
                    continue
                self._compute(i, self.actions[i])
                i += 1
            for work in self._s.sends:
                work.wait()
        self._free_sent_outputs()
        losses = self._s.losses
        del self._s
        return torch.stack(losses).mean() if losses else None

    # ---- communication ------------------------------------------------------------------
    def _receiver_chunk(self, a: Action) -> int:
        """The chunk on the peer that a SEND from our chunk `a.chunk` feeds."""
        step = 1 if a.kind == "SEND_F" else -1
        return rank_chunk_of(stage_of(self.rank, a.chunk, self.pp) + step, self.pp)[1]

    def _communicate(self, actions: list[Action]) -> None:
        ops, recv_keys = [], []
        for a in actions:
            kind = a.kind[-1]
            if a.kind.startswith("SEND"):
                key = (a.microbatch, a.chunk)
                tensor = (self._s.out[key] if kind == "F" else self._s.x.pop(key).grad).detach().contiguous()
                if a.peer == self.rank:
                    self._s.local[(kind, a.microbatch, self._receiver_chunk(a))] = tensor
                else:
                    ops.append(dist.P2POp(dist.isend, tensor, self._global(a.peer), self.group, TAGS[kind]))
                    recv_keys.append(("free", key) if kind == "F" else None)
            elif a.peer != self.rank:
                buffer = torch.empty(self._s.shape, dtype=self._s.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self._global(a.peer), self.group, TAGS[kind]))
                recv_keys.append((kind, a.microbatch, a.chunk))
        if not ops:
            return
        works = comm.batch_isend_irecv(ops)
        # NCCL coalesces a batch into fewer works than ops: then each op waits for all
        per_op = [[w] for w in works] if len(works) == len(ops) else [works] * len(ops)
        for key, op, op_works in zip(recv_keys, ops, per_op):
            if key is None or key[0] == "free":
                self._s.sends.extend(op_works)
                if key is not None:
                    self._s.to_free.append((self._s.out[key[1]], op_works))
            else:
                self._s.pending[key] = (op.tensor, op_works)

    def _received(self, kind: str, microbatch: int, chunk: int) -> torch.Tensor:
        key = (kind, microbatch, chunk)
        if key in self._s.local:
            return self._s.local.pop(key)
        buffer, works = self._s.pending.pop(key)
        for work in works:
            work.wait()
        return buffer

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    # ---- compute ------------------------------------------------------------------------
    def _deferred(self, index: int, chunk: int, final: bool = True) -> AbstractContextManager:
        """The context of a weight-gradient backward (`final`: the last of its (micro-batch,
        chunk)): "last", no_sync() for all but the rank's very last one; "every", the
        chunk's reduction for each final one."""
        if not final:
            return self.optimizer.no_sync()
        if self.grad_sync == "every":
            return self.optimizer.sync_only(self.chunks[chunk])
        return contextlib.nullcontext() if index == self._last_weight_grad else self.optimizer.no_sync()

    def _backward_input(self, key: tuple[int, int], out, grad: torch.Tensor | None) -> None:
        """Zero-bubble B: the input gradient only, sent upstream at once; the weight
        gradients are left for W (`parallel.pipeline.split_backward`)."""
        x = self._s.x.get(key)
        params = [p for p in self.chunks[key[1]].parameters() if p.requires_grad]
        dx, self._s.weight_work[key] = backward_input(out, grad, x, params)
        if x is not None:
            x.grad = dx

    def _free_sent_outputs(self) -> None:
        """Drop the storage of outputs whose send has completed: backward needs only their
        autograd node (it starts from the output's gradient edge), not their values."""
        still = []
        for out, works in self._s.to_free:
            if all(w.is_completed() for w in works):
                out.data = torch.empty(0, dtype=out.dtype, device=out.device)
            else:
                still.append((out, works))
        self._s.to_free = still

    def _compute(self, index: int, a: Action) -> None:
        """Run one F / B / W; its recorded start is after its input has arrived, so waiting
        counts as idle time in `events`."""
        self._free_sent_outputs()
        key = (a.microbatch, a.chunk)
        stage = stage_of(self.rank, a.chunk, self.pp)
        last = stage == self.n_stages - 1
        if a.kind == "F":
            x = self._s.inputs[a.microbatch] if stage == 0 else self._received("F", *key).requires_grad_()
            start = time.perf_counter() - self._s.t0
            chunk = self.chunks[a.chunk]
            if last:
                out = chunk(x, self._s.targets[a.microbatch])
            else:  # its MoE auxiliary losses join the backward as the loss of the micro-batch does
                with aux_loss.backward_scale(self.optimizer.scale_loss(torch.ones((), device=x.device) / self.m)):
                    out = chunk(x)
            if stage > 0:
                self._s.x[key] = x
            if last:
                self._s.losses.append(out.detach())
                out = self.optimizer.scale_loss(out / self.m)
            self._s.out[key] = out
        elif a.kind == "B":
            out = self._s.out.pop(key)
            grad = None if last else self._received("B", *key)
            start = time.perf_counter() - self._s.t0
            if not last:
                out = get_gradient_edge(out)
            if self.split:
                self._backward_input(key, out, grad)
            else:
                with self._deferred(index, a.chunk):
                    torch.autograd.backward(out, grad)
        else:
            start = time.perf_counter() - self._s.t0
            self._s.weight_work.pop(key).run(lambda final: self._deferred(index, a.chunk, final))
        self.events.append((self.rank, a.kind, a.microbatch, a.chunk, start, time.perf_counter() - self._s.t0))


def _device_of(chunks: list[nn.Module]) -> torch.device:
    """Where the chunks' parameters live, and so where received activations and gradients
    must land (a chunk without parameters computes on the CPU)."""
    return next((p.device for chunk in chunks for p in chunk.parameters()), torch.device("cpu"))
