"""`ZeroOptimizer.grad_peak_bytes`: the gradient bytes a rank held at most. At stage 2 a
full bucket exists from its first gradient until its reduce-scatter is retired, and at
most `MAX_IN_FLIGHT` reductions stay unretired, so a synced backward holds the shards plus
at most MAX_IN_FLIGHT + 1 full buckets (the next one fills while they fly). Under
`no_sync()` every bucket accumulates in full until the synced backward."""

from __future__ import annotations

import torch
import torch.nn as nn

from optim import ZeroOptimizer
from optim.grads import MAX_IN_FLIGHT
from optim.policies import Communication
from tests.dist_utils import run_distributed

WIDTH, LAYERS, MICRO = 32, 4, 3


def peaks(stage: int) -> dict[str, int]:
    out = {}
    for policy in ("no_sync", "every_backward"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        opt = ZeroOptimizer(
            model, torch.optim.AdamW, stage=stage, communication=Communication(bucket_numel=WIDTH * WIDTH), lr=1e-3
        )
        at_start = opt.grad_peak_bytes
        for i in range(MICRO):
            defer = policy == "no_sync" and i < MICRO - 1
            with opt.no_sync() if defer else torch.enable_grad():
                model(torch.randn(2, WIDTH)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        out[policy] = opt.grad_peak_bytes
        out["start"] = at_start
        out["now"] = opt.memory_breakdown()["grads"]
    return out


def test_stage2_holds_few_full_buckets_unless_accumulating_under_no_sync() -> None:
    bucket = WIDTH * WIDTH * 4  # fp32, one bucket per layer
    full, shard = LAYERS * bucket, LAYERS * bucket // 2
    stage2 = run_distributed(peaks, 2, 2)[0]
    assert stage2["start"] == stage2["now"] == shard
    assert stage2["no_sync"] == shard + full
    assert shard + bucket <= stage2["every_backward"] <= shard + (MAX_IN_FLIGHT + 1) * bucket < shard + full
    stage1 = run_distributed(peaks, 2, 1)[0]
    assert stage1["no_sync"] == stage1["every_backward"] == stage1["start"] == full
