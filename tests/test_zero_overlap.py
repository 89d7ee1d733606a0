"""Gradient reduction overlaps backward; stage 3 frees gathered parameters after use."""

from __future__ import annotations

import pytest
import torch

from optim import ZeroOptimizer
from optim.policies import Communication
from parallel import comm
from tests.dist_utils import run_distributed
from tests.models import make_model


def collectives_before_last_gradient(stage: int) -> tuple[int, int]:
    """(reductions launched when the embedding's gradient, the last one of backward,
    arrives; reductions launched by the end of backward)."""
    model = make_model()
    seen: list[int] = []
    op = "all_reduce" if stage == 0 else "reduce_scatter_tensor"
    # registered first, so it runs before the optimizer's own hook on this parameter
    model.emb.weight.register_post_accumulate_grad_hook(lambda p: seen.append(log.calls(op=op)))
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        communication=Communication(bucket_numel=1500, unit_numel=500, resident_numel=0),
    )
    idx = torch.randint(0, 37, (4, 8))
    with comm.tracking() as log:
        opt.backward(model(idx, idx))
    return seen[0], log.calls(op=op)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduction_starts_during_backward(stage: int) -> None:
    for during, total in run_distributed(collectives_before_last_gradient, 2, stage):
        assert 0 < during < total, (during, total)


def gathered_after_forward() -> tuple[int, int]:
    model = make_model()
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, stage=3, communication=Communication(unit_numel=500, resident_numel=100)
    )
    resident = sum(b.numel for b in opt.buckets if not b.sharding.parameters)
    idx = torch.randint(0, 37, (4, 8))
    loss = model(idx, idx)
    held = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt.backward(loss)
    held_after = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return held, held_after, resident


def test_stage3_holds_only_resident_units_outside_forward_and_backward() -> None:
    for held, held_after, resident in run_distributed(gathered_after_forward, 2):
        assert held == held_after and held <= resident, (held, held_after, resident)
