"""Runs one rank's schedule actions over its model chunks.

One `run` is one optimizer step's worth of pipeline work: m micro-batches through all
virtual stages. Forward of (micro-batch i, chunk c) feeds the chunk the token ids (first
virtual stage) or the activations received from the previous stage (as a leaf that
requires grad); the last virtual stage returns the micro-batch loss, and its backward
starts from scale_loss(loss_i / m) (an optimizer's fp16 loss scale), so the gradients are
those of the mean loss over micro-batches.
Every other backward starts from its output with the gradient received from the next
stage, and sends its input's gradient back.

Communication: each run of consecutive SEND / RECV actions becomes one
`batch_isend_irecv`; sends are never waited for before the end of the step and a receive
only right before the compute that consumes it, so no legal schedule can deadlock.
Activations and gradients use different tags, so two message kinds on one rank pair
never mix. A peer equal to this rank (pp = 1 with v > 1) is a local hand-off.
Once an output's send has completed its storage is freed (Megatron's "deallocate output
tensor"): backward starts from the output's gradient edge and never reads its values.
Gradient reduction over data parallelism, two policies. By default every backward but the
rank's last runs under `no_sync()` (an optimizer's context that defers gradient reduction),
so reduction starts when the rank's last backward runs. With `sync_chunk` (an optimizer's
`sync_only`) every backward of a (micro-batch, chunk) reduces that chunk's gradients.
Zero-bubble schedules split backward into B (input gradient only, sent upstream at once)
and W (weight gradients only), see `parallel.pipeline.split_backward`.
Per compute action the executor records (rank, kind, micro-batch, chunk, start, end) in
`events`, the format `parallel.pipeline.timeline` draws.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from parallel import comm
from parallel.pipeline.split_backward import WeightGradients, backward_input
from parallel.pipeline.schedules import COMM, Action, rank_chunk_of, schedule, splits_backward, stage_of, validate

TAGS = {"F": 0, "B": 1}


class PipelineExecutor:
    """Executes `schedule(name, pp, rank, microbatches, len(chunks))` on `chunks` (this
    rank's model chunks, chunk c holding virtual stage c·pp + rank)."""

    def __init__(
        self,
        chunks: list[nn.Module],
        schedule_name: str,
        microbatches: int,
        pp_group: dist.ProcessGroup | None = None,
        no_sync: Callable[[], ContextManager] | None = None,
        sync_chunk: Callable[[nn.Module], ContextManager] | None = None,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.chunks, self.m = chunks, microbatches
        self.group = pp_group
        self.pp, self.rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        validate(schedule_name, self.pp, microbatches, len(chunks))
        self.actions = schedule(schedule_name, self.pp, self.rank, microbatches, len(chunks))
        self.split = splits_backward(schedule_name)
        self.no_sync = no_sync or contextlib.nullcontext
        self.sync_chunk = sync_chunk
        self.scale_loss = scale_loss or (lambda loss: loss)
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
        self._shape, self._dtype = activation_shape, activation_dtype
        self._inputs, self._targets = inputs, targets
        self._x: dict[tuple[int, int], torch.Tensor] = {}
        self._out: dict[tuple[int, int], torch.Tensor] = {}
        self._grad: dict[tuple[int, int], torch.Tensor] = {}
        self._pending: dict[tuple[str, int, int], tuple[torch.Tensor, list[dist.Work]]] = {}
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}
        self._sends: list = []
        self._to_free: list[tuple[torch.Tensor, list[dist.Work]]] = []
        self._losses: list[torch.Tensor] = []
        self._weight_work: dict[tuple[int, int], WeightGradients] = {}
        self.events = []
        self._t0 = time.perf_counter()
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
        for work in self._sends:
            work.wait()
        self._free_sent_outputs()
        return torch.stack(self._losses).mean() if self._losses else None

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
                tensor = (self._out[key] if kind == "F" else self._x.pop(key).grad).detach().contiguous()
                if a.peer == self.rank:
                    self._local[(kind, a.microbatch, self._receiver_chunk(a))] = tensor
                else:
                    ops.append(dist.P2POp(dist.isend, tensor, self._global(a.peer), self.group, TAGS[kind]))
                    recv_keys.append(("free", key) if kind == "F" else None)
            elif a.peer != self.rank:
                buffer = torch.empty(self._shape, dtype=self._dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self._global(a.peer), self.group, TAGS[kind]))
                recv_keys.append((kind, a.microbatch, a.chunk))
        if not ops:
            return
        works = comm.batch_isend_irecv(ops)
        # NCCL coalesces a batch into fewer works than ops: then each op waits for all
        per_op = [[w] for w in works] if len(works) == len(ops) else [works] * len(ops)
        for key, op, op_works in zip(recv_keys, ops, per_op):
            if key is None or key[0] == "free":
                self._sends.extend(op_works)
                if key is not None:
                    self._to_free.append((self._out[key[1]], op_works))
            else:
                self._pending[key] = (op.tensor, op_works)

    def _received(self, kind: str, microbatch: int, chunk: int) -> torch.Tensor:
        key = (kind, microbatch, chunk)
        if key in self._local:
            return self._local.pop(key)
        buffer, works = self._pending.pop(key)
        for work in works:
            work.wait()
        return buffer

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    # ---- compute ------------------------------------------------------------------------
    def _deferred(self, index: int, chunk: int, final: bool = True) -> ContextManager:
        """The context of a weight-gradient backward (`final`: the last of its (micro-batch,
        chunk)): no_sync() for all but the rank's very last one, or with `sync_chunk`, the
        chunk's reduction for each final one."""
        if self.sync_chunk is not None:
            return self.sync_chunk(self.chunks[chunk]) if final else self.no_sync()
        return contextlib.nullcontext() if index == self._last_weight_grad and final else self.no_sync()

    def _backward_input(self, key: tuple[int, int], out, grad: torch.Tensor | None) -> None:
        """Zero-bubble B: the input gradient only, sent upstream at once; the weight
        gradients are left for W (`parallel.pipeline.split_backward`)."""
        x = self._x.get(key)
        params = [p for p in self.chunks[key[1]].parameters() if p.requires_grad]
        dx, self._weight_work[key] = backward_input(out, grad, x, params)
        if x is not None:
            x.grad = dx

    def _free_sent_outputs(self) -> None:
        """Drop the storage of outputs whose send has completed: backward needs only their
        autograd node (it starts from the output's gradient edge), not their values."""
        still = []
        for out, works in self._to_free:
            if all(w.is_completed() for w in works):
                out.data = torch.empty(0, dtype=out.dtype, device=out.device)
            else:
                still.append((out, works))
        self._to_free = still

    def _compute(self, index: int, a: Action) -> None:
        """Run one F / B / W; its recorded start is after its input has arrived, so waiting
        counts as idle time in `events`."""
        self._free_sent_outputs()
        key = (a.microbatch, a.chunk)
        stage = stage_of(self.rank, a.chunk, self.pp)
        last = stage == self.n_stages - 1
        if a.kind == "F":
            x = self._inputs[a.microbatch] if stage == 0 else self._received("F", *key).requires_grad_()
            start = time.perf_counter() - self._t0
            chunk = self.chunks[a.chunk]
            out = chunk(x, self._targets[a.microbatch]) if last else chunk(x)
            if stage > 0:
                self._x[key] = x
            if last:
                self._losses.append(out.detach())
                out = self.scale_loss(out / self.m)
            self._out[key] = out
        elif a.kind == "B":
            out = self._out.pop(key)
            grad = None if last else self._received("B", *key)
            start = time.perf_counter() - self._t0
            if not last:
                out = get_gradient_edge(out)
            if self.split:
                self._backward_input(key, out, grad)
            else:
                with self._deferred(index, a.chunk):
                    torch.autograd.backward(out, grad)
        else:
            start = time.perf_counter() - self._t0
            self._weight_work.pop(key).run(lambda final: self._deferred(index, a.chunk, final))
        self.events.append((self.rank, a.kind, a.microbatch, a.chunk, start, time.perf_counter() - self._t0))


def _device_of(chunks: list[nn.Module]) -> torch.device:
    """Where the chunks' parameters live, and so where received activations and gradients
    must land (a chunk without parameters computes on the CPU)."""
    return next((p.device for chunk in chunks for p in chunk.parameters()), torch.device("cpu"))
