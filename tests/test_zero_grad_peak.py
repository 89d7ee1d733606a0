"""`ZeroOptimizer.grad_peak_bytes`: the gradient bytes a rank held at most. At stage 2 a
full bucket exists from its first gradient until its reduce-scatter is retired, and at
most `MAX_IN_FLIGHT` reductions stay unretired, so a synced backward holds the shards plus
at most MAX_IN_FLIGHT + 1 full buckets (the next one fills while they fly). Under
`no_sync()` every bucket accumulates in full until the synced backward. The full buckets a
stage-2 rank drops are freed: nothing keeps a reference to them."""

from __future__ import annotations

import gc
import weakref
from functools import partial

import torch
import torch.nn as nn

from optim import ZeroOptimizer
from optim.grads import MAX_IN_FLIGHT
from optim.policies import Communication
from tests.dist_utils import run_distributed

WIDTH, LAYERS, MICRO = 32, 4, 3


def remember(opt: ZeroOptimizer, seen: list[weakref.ref], _: torch.Tensor) -> None:
    seen.extend(weakref.ref(b.grad_buffer) for b in opt.buckets if b.grad_buffer is not None)


def peaks(stage: int) -> dict[str, int]:
    out = {}
    for policy in ("no_sync", "every_backward"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        opt = ZeroOptimizer(
            model, torch.optim.AdamW, stage=stage, communication=Communication(bucket_numel=WIDTH * WIDTH), lr=1e-3
        )
        at_start = opt.grad_peak_bytes
        seen: list[weakref.ref] = []  # weak references to the full gradient buffers that exist in backward
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(partial(remember, opt, seen))
        for i in range(MICRO):
            defer = policy == "no_sync" and i < MICRO - 1
            with opt.no_sync() if defer else torch.enable_grad():
                model(torch.randn(2, WIDTH)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        out[policy] = opt.grad_peak_bytes
        out["start"] = at_start
        out["now"] = opt.memory_breakdown()["grads"]
        gc.collect()
        out[f"{policy} full buffers alive"] = len({id(r()) for r in seen if r() is not None})
    return out


def test_stage2_holds_few_full_buckets_unless_accumulating_under_no_sync() -> None:
    bucket = WIDTH * WIDTH * 4  # fp32, one bucket per layer
    full, shard = LAYERS * bucket, LAYERS * bucket // 2
    stage2 = run_distributed(peaks, 2, 2)[0]
    assert stage2["start"] == stage2["now"] == shard
    assert stage2["no_sync"] == shard + full
    assert shard + bucket <= stage2["every_backward"] <= shard + (MAX_IN_FLIGHT + 1) * bucket < shard + full
    assert stage2["no_sync full buffers alive"] == stage2["every_backward full buffers alive"] == 0
    stage1 = run_distributed(peaks, 2, 1)[0]
    assert stage1["no_sync"] == stage1["every_backward"] == stage1["start"] == full
    assert stage1["every_backward full buffers alive"] == LAYERS  # stage 1 keeps its full buckets
