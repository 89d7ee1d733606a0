"""ZeRO++ qwZ (`ZeroOptimizer(zero_plus_plus=ZeroPlusPlus(qwz_block=...))`): the parameter
all-gathers (stage 3's before use, stages 1-2's after the step) send int8 blocks and fp32
scales, a quarter of the fp32 bytes; training follows the exact run closely (the masters and
the update stay exact, only the gathered compute copy of other ranks' shards is rounded);
refused at stage 0."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from optim import ZeroOptimizer
from optim.policies import Communication, ZeroPlusPlus
from tests.dist_utils import run_distributed
from tests.models import batches, make_model
from tests.zero_runs import construction_error, tracked_steps

pytestmark = pytest.mark.slow

# every stage-3 unit is gathered
UNITS = {"communication": Communication(bucket_numel=1500, unit_numel=500, resident_numel=0)}
STEPS, BLOCK = 50, 64


def train(stage: int, qwz_block: int | None) -> dict:
    model = make_model()
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, stage=stage, lr=3e-3, zero_plus_plus=ZeroPlusPlus(qwz_block=qwz_block), **UNITS
    )
    losses, logs = tracked_steps(model, opt, STEPS)
    gathered = sum(
        ops["all_gather_into_tensor"]["bytes"]
        for log in logs
        for ops in log.values()
        if "all_gather_into_tensor" in ops
    )
    shards = [b.shard_numel for b in opt.buckets]
    return {"losses": losses, "gathered": gathered, "weights": opt.full_state_dict(), "shards": shards}


def both(stage: int) -> dict:
    return {"exact": train(stage, None), "qwz": train(stage, BLOCK)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_qwz_quarter_bytes_and_close_losses(stage: int) -> None:
    """50 steps of the tiny model on 2 ranks. Measured (2026-11-24): bytes 0.276 of the exact
    run's at stages 1-2, 0.279 at stage 3; losses within 0.16 % (stages 1-2) and 0.39 %
    (stage 3) of the exact run's at every step; the bound is 2 %."""
    for result in run_distributed(both, 2, stage):
        exact, qwz = result["exact"], result["qwz"]
        ratio = qwz["gathered"] / exact["gathered"]
        # 1 byte per element (each shard padded to whole blocks) + 4 per block, against 4 bytes
        assert 0.25 < ratio < 0.3, ratio
        if stage < 3:  # every bucket gathered once a step: (N−1)·(padded shard + 4 per block) bytes
            shards, n = qwz["shards"], 2
            rounds = exact["gathered"] // (4 * (n - 1) * sum(shards))
            assert exact["gathered"] == rounds * 4 * (n - 1) * sum(shards) and rounds == STEPS
            assert qwz["gathered"] == rounds * (n - 1) * sum(-(-c // BLOCK) * (BLOCK + 4) for c in shards)
        worst = max(abs(a - b) / b for a, b in zip(qwz["losses"], exact["losses"]))
        assert worst < 0.02, (worst, qwz["losses"], exact["losses"])
        assert qwz["losses"][-1] < 0.8 * qwz["losses"][0]  # it trains
        assert any(not torch.equal(exact["weights"][k], v) for k, v in qwz["weights"].items())  # it is lossy


@pytest.mark.timeout(60)
def test_qwz_is_refused_at_stage_0() -> None:
    (message,) = run_distributed(construction_error, 1, 0, zero_plus_plus=ZeroPlusPlus(qwz_block=64))
    assert "needs stage 1-3" in message, message


def _checkpoint_is_exact(path: str) -> dict:
    """5 steps at stage 2 with qwZ and qgZ, a DCP checkpoint, loaded into an exact optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, stage=2, lr=3e-3, zero_plus_plus=ZeroPlusPlus(qwz_block=BLOCK, qgz_bits=8), **UNITS
    )
    for idx, tgt in batches(5, 8):
        mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
        model(idx[mine], tgt[mine]).backward()
        opt.step()
        opt.zero_grad()
    masters = opt.full_state_dict()
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)
    fresh = ZeroOptimizer(make_model(), torch.optim.AdamW, stage=2, lr=3e-3, **UNITS)
    state = {"optim": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["optim"])
    loaded = fresh.full_state_dict()
    return {
        "same": all(torch.equal(loaded[k], v) for k, v in masters.items()),
        "live_differs": any(not torch.equal(live[k], v) for k, v in masters.items()),
    }


@pytest.mark.timeout(120)
def test_a_checkpoint_holds_the_exact_masters(tmp_path) -> None:
    """The compute copy of other ranks' shards is quantized; the checkpoint is not: loaded into
    an exact optimizer it gives back the masters bit for bit."""
    for r in run_distributed(_checkpoint_is_exact, 2, str(tmp_path)):
        assert r["same"] and r["live_differs"], r
