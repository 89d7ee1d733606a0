"""ZeRO++ qwZ at stage 3 (`ZeroOptimizer(qwz_block=...)`): the parameter all-gathers send int8
blocks and fp32 scales, a quarter of the fp32 bytes; training follows the exact run closely
(the masters and the update stay exact, only the gathered compute copy is rounded); and the
option is refused where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optim import ZeroOptimizer
from parallel import comm
from tests.dist_utils import run_distributed
from tests.models import batches, make_model

UNITS = {"bucket_numel": 1500, "unit_numel": 500, "resident_numel": 0}  # every stage-3 unit is gathered
STEPS, BLOCK = 30, 64


def train(qwz_block: int | None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=3e-3, qwz_block=qwz_block, **UNITS)
    losses, gathered = [], 0
    for idx, tgt in batches(STEPS, 8):
        mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
        with comm.tracking() as log:
            loss = model(idx[mine], tgt[mine])
            loss.backward()
        gathered += log.total_bytes(op="all_gather_into_tensor")
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {"losses": losses, "gathered": gathered, "weights": opt.full_state_dict()}


def both() -> dict:
    return {"exact": train(None), "qwz": train(BLOCK)}


@pytest.mark.timeout(120)
def test_qwz_quarter_bytes_and_close_losses() -> None:
    for result in run_distributed(both, 2):
        exact, qwz = result["exact"], result["qwz"]
        ratio = qwz["gathered"] / exact["gathered"]
        # 1 byte per element (each shard padded to whole blocks) + 4 per block, against 4 bytes
        assert 0.25 < ratio < 0.3, ratio
        worst = max(abs(a - b) / b for a, b in zip(qwz["losses"], exact["losses"]))
        assert worst < 0.02, (worst, qwz["losses"], exact["losses"])
        assert qwz["losses"][-1] < 0.8 * qwz["losses"][0]  # it trains
        assert any(not torch.equal(exact["weights"][k], v) for k, v in qwz["weights"].items())  # it is lossy


def refused(stage: int) -> str:
    try:
        ZeroOptimizer(make_model(), torch.optim.AdamW, stage=stage, qwz_block=64)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_qwz_needs_stage_3() -> None:
    (message,) = run_distributed(refused, 1, 2)
    assert "needs stage=3" in message, message
