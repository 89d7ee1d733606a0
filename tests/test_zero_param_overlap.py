"""Overlapped parameter all-gather at stages 1-2
(`ZeroOptimizer(communication=Communication(overlap_param_gather=True))`, Megatron's
overlap-param-gather): `step()` returns with the gathers in flight, each bucket's
is finished just before the first forward of a module holding its parameters, and training
is the same as with the gathers finished inside `step()`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from optim import ZeroOptimizer
from optim.policies import Communication, ZeroPlusPlus
from tests.dist_utils import run_distributed
from tests.models import reference_run
from tests.test_zero_memory_comm import mlp
from tests.test_zero_parity import assert_matches
from tests.zero_runs import zero_train

STEPS, BATCH, MICRO, LR = 10, 16, 2, 1e-2
SMALL = {"communication": Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlapped_gathers_match_torch(stage: int) -> None:
    """Stage 3 publishes only its resident units after the step: those overlap too."""
    zero_kwargs = {"communication": dataclasses.replace(SMALL["communication"], overlap_param_gather=True)}
    out = run_distributed(zero_train, 2, stage, STEPS, BATCH, MICRO, lr=LR, zero_kwargs=zero_kwargs)
    ref = reference_run(STEPS, BATCH, MICRO, 2, torch.optim.AdamW, lr=LR)
    for result in out:
        assert_matches(result, ref)


def _pending_through_forward(qwz_block: int | None) -> dict:
    model = mlp()
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=2,
        communication=Communication(bucket_numel=1, overlap_param_gather=True),
        zero_plus_plus=ZeroPlusPlus(qwz_block=qwz_block),
    )
    seen = []
    for layer in model:
        layer.register_forward_pre_hook(lambda m, a: seen.append(len(opt._shard_step.gathers)))
    x = torch.randn(4, 31)
    opt.backward(model(x).pow(2).mean())
    opt.step()
    after_step = len(opt._shard_step.gathers)
    model(x)
    after_forward = len(opt._shard_step.gathers)
    opt.backward(model(x).pow(2).mean())
    opt.step()
    model.state_dict()
    return {
        "buckets": len(opt.buckets),
        "after_step": after_step,
        "seen": seen[len(model) : 2 * len(model)],  # the forward after the first step
        "after_forward": after_forward,
        "after_state_dict": len(opt._shard_step.gathers),
        "rank": dist.get_rank(),
    }


@pytest.mark.parametrize("qwz_block", [None, 64])
def test_each_gather_is_finished_just_before_its_first_use(qwz_block: int | None) -> None:
    """One bucket per parameter (3 Linear layers, 6 buckets): all 6 gathers are in flight when
    step() returns; each layer's forward finishes its own 2 first, so a hook after it sees 4,
    2 and 0 still pending at the three layers (4 and 2 at the GELUs between them); the model's
    state_dict() finishes all."""
    for r in run_distributed(_pending_through_forward, 2, qwz_block):
        assert r["buckets"] == 6 and r["after_step"] == 6
        assert r["seen"] == [4, 4, 2, 2, 0]
        assert r["after_forward"] == 0 and r["after_state_dict"] == 0
