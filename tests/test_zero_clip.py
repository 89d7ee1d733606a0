"""The global grad norm across data- and model-parallel groups counts every parameter once.

World 4 = 2 model-parallel ranks × 2 data-parallel ranks. Both model-parallel ranks hold
the whole TinyLM and see the same data, standing in for tensor-parallel ranks: parameters
marked replicated over the model-parallel group (the 1-D ones, as TP replicates norms and
row-parallel biases) must be counted once, the others (standing in for TP shards) on
each rank, so ‖g‖² = 2·Σ_unmarked g² + Σ_marked g².
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from optim import ZeroOptimizer
from optim.policies import Communication
from parallel import comm
from tests.dist_utils import run_distributed
from tests.models import batches, make_model


def norm_with_marks(stage: int) -> float:
    rank = dist.get_rank()
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, mp = dp_groups[rank // 2], mp_groups[rank % 2]
    model = make_model()
    for name, p in model.named_parameters():
        if p.ndim == 1:
            comm.mark_replicated(model, name, mp)
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        process_group=dp,
        model_parallel_group=mp,
        communication=Communication(bucket_numel=1500, unit_numel=500),
    )
    idx, tgt = batches(1, 8)[0]
    rows = slice(4 * (rank % 2), 4 * (rank % 2) + 4)  # the data-parallel index
    opt.backward(model(idx[rows], tgt[rows]))
    return float(opt.clip_grad_norm_(1e9))


def expected_norm() -> float:
    model = make_model()
    idx, tgt = batches(1, 8)[0]
    for rows in (slice(0, 4), slice(4, 8)):
        (model(idx[rows], tgt[rows]) / 2).backward()
    sq = sum(
        (2 if p.ndim > 1 else 1) * p.grad.double().pow(2).sum().item() for p in model.parameters() if p.requires_grad
    )
    return math.sqrt(sq)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_replicated_parameters_count_once(stage: int) -> None:
    expected = expected_norm()
    for norm in run_distributed(norm_with_marks, 4, stage):
        assert norm == pytest.approx(expected, rel=1e-5)
