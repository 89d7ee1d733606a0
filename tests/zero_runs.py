"""Distributed training loops with ZeroOptimizer, run on every rank by the tests."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from optim import ZeroOptimizer
from optim.policies import MixedPrecision
from parallel import ParallelDims, accounting
from tests.models import batches, make_model, micro_slices, no_decay_groups


def zero_train(
    stage: int,
    steps: int = 10,
    global_batch: int = 16,
    micro: int = 2,
    param_dtype: torch.dtype | None = None,
    optimizer_class: type = torch.optim.AdamW,
    clip: float | None = 0.5,
    make: Callable[[], nn.Module] = make_model,
    use_no_sync: bool = False,
    before_step: Callable[[nn.Module, int], None] | None = None,
    zero_kwargs: dict[str, Any] | None = None,
    save: tuple[int, str] | None = None,
    load: str | None = None,
    dims: dict[str, Any] | None = None,
    clip_param_groups: bool = False,
    **opt_kwargs: Any,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train with ZeroOptimizer as `tests.models.reference_run` does in one process:
    same global batches, each rank on its 1/N slice in `micro` micro-batches. Returns the
    global mean loss per step and the full (gathered) state dict.

    `save=(k, dir)` writes a torch.distributed.checkpoint after k steps and stops there;
    `load=dir` resumes from one (optimizer + LR scheduler) at the step it was saved.
    `dims`: a `ParallelDims(**dims)` layout (`dp_shard` for hybrid sharding, `ranks_per_node`)
    whose shard, replicate and node groups the optimizer uses. `param_dtype` is the compute
    dtype of the optimizer's `precision`, which `zero_kwargs` may give (for its loss scaler or
    reduce dtype). `clip_param_groups`: clip as Lightning and Fabric do, with
    `torch.nn.utils.clip_grad_norm_` over the tensors in the optimizer's param_groups."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make()
    zero_kwargs = dict(zero_kwargs or {})
    precision = zero_kwargs.pop("precision", None) or MixedPrecision()
    if param_dtype is not None:
        precision = dataclasses.replace(precision, param_dtype=param_dtype)
    if dims is not None:
        layout = ParallelDims(**dims).build()
        zero_kwargs["process_group"] = layout.dp_shard_group
        zero_kwargs["replicate_group"] = layout.dp_replicate_group
        zero_kwargs["node_groups"] = layout.dp_shard_node_groups
    opt = ZeroOptimizer(
        model,
        optimizer_class,
        stage=stage,
        param_groups=no_decay_groups(model),
        precision=precision,
        **zero_kwargs,
        **opt_kwargs,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    if load is not None:
        state = {"optim": opt.state_dict(), "sched": sched.state_dict()}
        dcp.load(state, checkpoint_id=load)
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
    losses = []
    for step, (idx, tgt) in enumerate(batches(steps, global_batch)):
        if step < sched.last_epoch:
            continue
        if save is not None and step == save[0]:
            dcp.save({"optim": opt.state_dict(), "sched": sched.state_dict()}, checkpoint_id=save[1])
            break
        if before_step is not None:
            before_step(model, step)
        total = torch.zeros(())
        slices = micro_slices(global_batch, world, rank, micro)
        for k, sl in enumerate(slices):
            quiet = use_no_sync and k < len(slices) - 1
            with opt.no_sync() if quiet else contextlib.nullcontext():
                loss = model(idx[sl], tgt[sl])
                opt.backward(loss)
            total += loss.detach().float() / micro
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if clip is not None and clip_param_groups:
            torch.nn.utils.clip_grad_norm_([t for g in opt.param_groups for t in g["params"]], clip)
        elif clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses, opt.full_state_dict()


def construction_error(stage: int, **zero_kwargs: Any) -> str:
    """The sentence ZeroOptimizer(make_model(), AdamW, stage=stage, **zero_kwargs) raises."""
    try:
        ZeroOptimizer(make_model(), torch.optim.AdamW, stage=stage, **zero_kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


def tracked_steps(model: nn.Module, opt: ZeroOptimizer, steps: int, batch: int = 8) -> tuple[list[float], list[dict]]:
    """`steps` plain steps (each rank on its slice of the global batch, no accumulation): the
    global mean loss of each, and each step's `accounting.CommLog.as_dict()` (forward, backward, step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, logs = [], []
    for idx, tgt in batches(steps, batch):
        mine = slice(rank * batch // world, (rank + 1) * batch // world)
        with accounting.tracking() as log:
            loss = model(idx[mine], tgt[mine])
            loss.backward()
            opt.step()
        opt.zero_grad()
        logs.append(log.as_dict())
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses, logs
