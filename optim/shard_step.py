"""The optimizer step on this rank's flat shards, exact per parameter: a parameter is
stepped only if it has a gradient this step, with its own step count. Adam / AdamW run the
fused step (optim.fused) once per group of ranges whose parameters share a step count;
any other elementwise optimizer runs its own `step()` on the fp32 master shards, once for all
buckets whose parameters are stepped alike and once per run of ranges otherwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from optim import fused
from optim.buffers import FlatBucket
from optim.collectives import ShardGather, all_gather_shards
from optim.stage3 import ParamGatherer
from parallel import flight

if TYPE_CHECKING:
    from optim.zero_state import ZeroState


class ShardStep:
    """The step on this rank's shards (see module docstring) and the all-gathers that publish
    the updated parameters. `param_steps[k][i]`: how many steps parameter i of bucket k has
    taken (torch's per-parameter "step"); `gathers`: the all-gathers still in flight."""

    def __init__(self, shared: ZeroState, backend: str, gatherer: ParamGatherer | None) -> None:
        self.shared, self.backend, self.gatherer = shared, backend, gatherer
        self.buckets, self.inner, self.optimizer_class = shared.buckets, shared.inner, shared.optimizer_class
        self.qwz, self.overlap_param_gather = shared.zero_plus_plus.qwz, shared.communication.overlap_param_gather
        self.param_steps = [[0] * len(b.params) for b in self.buckets]
        self.state, self.param_groups = self.inner.state, self.inner.param_groups
        self.gathers: dict[FlatBucket, ShardGather] = {}

    def _runs(self, k: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """Bucket k's parameters stepped now, grouped by their step count so far: (count,
        master ranges [a, b)); one range over the whole master when all are alike."""
        b, stepping, steps = self.buckets[k], self.buckets[k].has_grad, self.param_steps[k]
        if all(stepping) and len(set(steps)) == 1:
            return [(steps[0], [(0, b.master.numel())])]
        runs: dict[int, list[tuple[int, int]]] = {}
        for i, s, e, at in b.ranges_of(*b.opt_range):
            if stepping[i]:
                runs.setdefault(steps[i], []).append((at, at + e - s))
        return sorted(runs.items())

    def fusable(self) -> bool:
        return all(fused.adam_hyperparams(g, self.optimizer_class) is not None for g in self.param_groups)

    def _fused_step(self, k: int, multiplier: float) -> None:
        """Adam/AdamW on bucket k's shard in one pass per run of parameters with the same step
        count, writing the low-precision params too. The state keeps torch's keys and layout,
        so it is interchangeable with the inner step."""
        b = self.buckets[k]
        self.init_adam_state(b.master)
        state = self.state[b.master]
        hyper = fused.adam_hyperparams(self.param_groups[b.group_index], self.optimizer_class)
        low = b.opt_param if b.opt_param.data_ptr() != b.master.data_ptr() else None
        for count, ranges in self._runs(k):
            fused.adam_step_(
                self.backend,
                [b.master[lo:hi] for lo, hi in ranges],
                [b.grad_shard[lo:hi] for lo, hi in ranges],
                [state["exp_avg"][lo:hi] for lo, hi in ranges],
                [state["exp_avg_sq"][lo:hi] for lo, hi in ranges],
                [None if low is None else low[lo:hi] for lo, hi in ranges],
                step=count + 1,
                grad_scale=multiplier,
                **hyper,
            )
        state["step"].fill_(max(self.param_steps[k]) + 1)

    def init_adam_state(self, master: torch.Tensor) -> None:
        state = self.state[master]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)

    def _inner_step(self, multiplier: float) -> None:
        """Any elementwise optimizer: its own step on the fp32 master shards. Buckets whose
        parameters are stepped alike take one step together; the others one per run."""
        whole, partial = [], []
        for k, b in enumerate(self.buckets):
            b.master.grad = None  # not the `.grad` placeholder shown between backward and step
            runs = self._runs(k)
            if len(runs) == 1 and runs[0][1] == [(0, b.master.numel())]:
                whole.append((b, runs[0][0]))
            elif runs:
                partial.append((b, runs))
        for b, count in whole:
            self._set_inner_count(b.master, count)
            b.master.grad = b.grad_shard.float().mul_(multiplier)
        self.inner.step()
        for b, _ in whole:
            b.master.grad = None
        for b, runs in partial:
            self._inner_step_runs(b, runs, multiplier)
        for b in self.buckets:
            b.write_master_to_params()

    def _inner_step_runs(self, b: FlatBucket, runs: list[tuple[int, list[tuple[int, int]]]], multiplier: float) -> None:
        """The inner step on ranges of one master only: for each run, the step from the state
        before (a fresh state for parameters never stepped, so first-step rules apply), kept
        only on the run's ranges; the other ranges keep their values and state."""
        master = b.master
        before_master, before_state = master.clone(), _clone_state(self.state[master])
        result_master, result_state = master.clone(), _clone_state(before_state)
        grad = b.grad_shard.float().mul_(multiplier)
        for count, ranges in runs:
            master.copy_(before_master)
            self.inner.state[master] = _clone_state(before_state) if count > 0 else {}
            self._set_inner_count(master, count)
            master.grad = grad
            self.inner.step()
            master.grad = None
            after = self.inner.state[master]
            for key, value in after.items():
                if isinstance(value, torch.Tensor) and value.shape == master.shape:
                    target = result_state.setdefault(key, torch.zeros_like(value))
                    for lo, hi in ranges:
                        target[lo:hi] = value[lo:hi]
                elif key not in result_state:
                    result_state[key] = value
            for lo, hi in ranges:
                result_master[lo:hi] = master[lo:hi]
        master.copy_(result_master)
        self.inner.state[master] = result_state

    def _set_inner_count(self, master: torch.Tensor, count: int) -> None:
        """The inner optimizer's scalar "step" set to the parameters' own count."""
        step = self.state[master].get("step")
        if isinstance(step, torch.Tensor):
            step.fill_(count)

    def update_and_publish(self, multiplier: float) -> None:
        """The step on every shard of the parameters with a gradient (each parameter's step
        count then advances), the updated parameters published as `publish` does. With the
        fused Adam step each bucket's all-gather starts as soon as that bucket is stepped, so
        that it travels while the next buckets are stepped."""
        if self.fusable():
            self.publish(before_gather=lambda k: self._fused_step(k, multiplier))
        else:
            self._inner_step(multiplier)
            self.publish()
        for steps, b in zip(self.param_steps, self.buckets):
            for i, has_grad in enumerate(b.has_grad):
                steps[i] += has_grad

    def publish(self, before_gather: Callable[[int], None] | None = None) -> None:
        """All-gather updated shards into the full parameter buffers (stages 1-2 and
        resident stage-3 units); stage 0 updated everything, stage 3 gathers on use. With
        `qwz` the shards travel quantized and each rank keeps its own shard exact.
        `before_gather(k)` runs just before bucket k's gather starts. With
        `overlap_param_gather` the gathers are left in flight: `wait` finishes a bucket's just
        before the first forward that uses it (or anything else that reads it)."""
        if self.gatherer is not None:
            self.gatherer.forget_secondary()
        self.wait()
        for k, b in enumerate(self.buckets):
            if before_gather is not None:
                before_gather(k)
            self._start_gather(b)
        if not self.overlap_param_gather:
            self.wait()

    def _start_gather(self, b: FlatBucket) -> None:
        """Bucket b's all-gather of the updated shards, left in flight (stages 1-2 and
        resident stage-3 units)."""
        if b.sharding.optimizer_state and not b.sharding.parameters:
            with flight.doing("the parameter all-gather after step()"):
                self.gathers[b] = all_gather_shards(b.param_buffer, b.param_shard, b.group, self.qwz)

    def wait(self, buckets: list[FlatBucket] | None = None) -> None:
        """Finish the parameter all-gathers still in flight (of `buckets`; None: all)."""
        for b in list(self.gathers) if buckets is None else buckets:
            gather = self.gathers.pop(b, None)
            if gather is not None:
                gather.finish(keep=b.rank)


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
