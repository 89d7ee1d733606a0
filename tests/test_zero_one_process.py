"""ZeroOptimizer on one process (world size 1): no torch.distributed collective at all, and
the same training as torch.optim.AdamW on the same batches, for stages 0-3."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from optim import ZeroOptimizer
from optim.policies import Communication, ZeroPlusPlus
from parallel import accounting
from tests.dist_utils import forbid_collectives, run_distributed
from tests.models import batches, make_model, micro_slices, no_decay_groups, reference_run

STEPS, BATCH, MICRO = 6, 8, 2
LR = 1e-2
SMALL = Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)


def train_alone(stage: int, **zero_kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """zero_train's loop (two micro-batches, clipping, an LR schedule) on the only rank, with
    every torch.distributed collective raising; also a state_dict round trip. Returns the
    losses, the full state dict and comm's log (calls counted, 0 bytes). `communication`
    defaults to SMALL."""
    zero_kwargs = {"communication": SMALL, **zero_kwargs}
    forbid_collectives()
    model = make_model()
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        param_groups=no_decay_groups(model),
        lr=LR,
        **zero_kwargs,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    losses = []
    with accounting.tracking() as log:
        for idx, tgt in batches(STEPS, BATCH):
            total = 0.0
            for sl in micro_slices(BATCH, 1, 0, MICRO):
                loss = model(idx[sl], tgt[sl])
                opt.backward(loss)
                total += loss.item() / MICRO
            losses.append(total)
            opt.clip_grad_norm_(0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
        opt.load_state_dict(opt.state_dict())
        full = opt.full_state_dict()
    return losses, full, log.as_dict()


@pytest.mark.parametrize(
    "stage,options",
    [
        (0, {}),
        (1, {}),
        (2, {}),
        (3, {}),
        (1, {"communication": dataclasses.replace(SMALL, overlap_param_gather=True, find_unused_parameters=False)}),
        (2, {"zero_plus_plus": ZeroPlusPlus(qwz_block=64)}),
    ],
    ids=["stage0", "stage1", "stage2", "stage3", "stage1-overlap", "stage2-qwz"],
)
def test_one_process_needs_no_collective_and_matches_adamw(stage: int, options: dict) -> None:
    losses, state, log = run_distributed(train_alone, 1, stage, **options)[0]
    ref_losses, ref_state = reference_run(STEPS, BATCH, MICRO, 1, torch.optim.AdamW, lr=LR)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert state.keys() == ref_state.keys()
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert log and all(e["bytes"] == 0 for ops in log.values() for e in ops.values())
