"""Gradient reduction overlaps backward (and, inside `overlapped_reductions()`, what follows
it); stage 3 frees gathered parameters after use."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

from optim import ZeroOptimizer
from optim.grads import MAX_IN_FLIGHT
from optim.policies import Communication
from parallel import accounting, comm
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
    with accounting.tracking() as log:
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


LATE_S = 1.0  # rank 1 starts each backward this late, so rank 0's reductions wait for it


def backward_under_a_late_peer(stage: int, overlapped: bool, backwards: int = 1) -> tuple[float, float, float]:
    """Rank 0's (seconds until backward returned, seconds until the gradients were whole,
    the gradient norm) for `backwards` synced backward passes, rank 1 starting each LATE_S
    late; inside `overlapped_reductions()` or not."""
    model = make_model()
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        communication=Communication(
            bucket_numel=1500, unit_numel=500, resident_numel=0, find_unused_parameters=False
        ),  # with it, each backward ends by agreeing with the peer on which gradients exist
    )
    assert len(opt.buckets) > MAX_IN_FLIGHT + 1
    idx = torch.randint(0, 37, (4, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    comm.barrier()
    start = time.perf_counter()
    with opt.overlapped_reductions() if overlapped else contextlib.nullcontext():
        for _ in range(backwards):
            if dist.get_rank() == 1:
                time.sleep(LATE_S)
            opt.backward(model(idx, idx))
        returned = time.perf_counter() - start
    whole = time.perf_counter() - start
    return returned, whole, float(opt.clip_grad_norm_(1e9))


def late_peer_cases() -> dict[str, tuple[float, float, float]]:
    cases = {"stage1": (1, False), "stage0 overlapped": (0, True), "stage1 overlapped": (1, True)}
    cases["stage2 overlapped"] = (2, True)
    out = {name: backward_under_a_late_peer(stage, overlapped) for name, (stage, overlapped) in cases.items()}
    out["stage1 twice"] = backward_under_a_late_peer(1, False, backwards=2)
    out["stage1 twice overlapped"] = backward_under_a_late_peer(1, True, backwards=2)
    return out


@pytest.mark.slow
def test_overlapped_reductions_leave_backward_free_where_the_buckets_stay() -> None:
    """At stages 0-1 (full buckets kept anyway) a backward inside `overlapped_reductions()`
    returns while a late peer still holds its reductions, and leaving the context waits for
    them; at stage 2 backward still waits once MAX_IN_FLIGHT full buckets are in flight (its
    memory bound). A second backward into buckets still being reduced waits for them first:
    the gradients equal those of the plain run."""
    r = run_distributed(late_peer_cases, 2, timeout=180)[0]
    assert r["stage1"][0] > 0.8 * LATE_S, r
    for name in ("stage0 overlapped", "stage1 overlapped"):
        returned, whole, _ = r[name]
        assert returned < 0.5 * LATE_S < 0.8 * LATE_S < whole, (name, r)
    assert r["stage2 overlapped"][0] > 0.8 * LATE_S, r
    norms = [r[name][2] for name in ("stage1", "stage0 overlapped", "stage1 overlapped", "stage2 overlapped")]
    assert max(norms) - min(norms) < 1e-6 * max(norms), norms
    assert abs(r["stage1 twice"][2] - r["stage1 twice overlapped"][2]) < 1e-6 * r["stage1 twice"][2], r
    assert abs(r["stage1 twice"][2] - 2 * r["stage1"][2]) < 1e-5 * r["stage1 twice"][2], r
