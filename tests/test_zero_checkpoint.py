"""Sharded ZeroOptimizer checkpoints load under a different data-parallel size and stage."""

from __future__ import annotations

import pytest
import torch

from optim.policies import Communication
from tests.dist_utils import run_distributed
from tests.models import reference_run
from tests.test_zero_parity import BATCH, LR, MICRO, STEPS, assert_matches
from tests.zero_runs import zero_train

SMALL = {"communication": Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)}


@pytest.mark.slow
def test_save_4_ranks_stage3_load_2_ranks_stage1(tmp_path) -> None:
    """Save after 5 steps on 4 ranks at stage 3, resume on 2 ranks at stage 1 for 5 more:
    the losses and weights equal an uninterrupted single-process run."""
    ckpt = str(tmp_path / "ckpt")
    first = run_distributed(zero_train, 4, 3, STEPS, BATCH, MICRO, lr=LR, zero_kwargs=SMALL, save=(5, ckpt))
    second = run_distributed(zero_train, 2, 1, STEPS, BATCH, MICRO, lr=LR, zero_kwargs=SMALL, load=ckpt)
    ref_losses, ref_state = reference_run(STEPS, BATCH, MICRO, 4, torch.optim.AdamW, lr=LR)
    losses = first[0][0] + second[0][0]
    assert_matches((losses, second[0][1]), (ref_losses, ref_state))


def test_save_1_rank_stage0_bf16_load_3_ranks_stage2(tmp_path) -> None:
    """bf16 masters round-trip in fp32; 3 ranks (uneven shards) at stage 2 resume exactly
    as the uninterrupted bf16 run on 1 rank."""
    ckpt = str(tmp_path / "ckpt")
    whole = run_distributed(zero_train, 1, 0, STEPS, 12, MICRO, torch.bfloat16, lr=LR, zero_kwargs=SMALL)
    run_distributed(zero_train, 1, 0, STEPS, 12, MICRO, torch.bfloat16, lr=LR, zero_kwargs=SMALL, save=(4, ckpt))
    resumed = run_distributed(zero_train, 3, 2, STEPS, 12, 1, torch.bfloat16, lr=LR, zero_kwargs=SMALL, load=ckpt)
    torch.testing.assert_close(torch.tensor(resumed[0][0]), torch.tensor(whole[0][0][4:]), rtol=2e-2, atol=0)
    for k, v in whole[0][1].items():
        torch.testing.assert_close(resumed[0][1][k], v, rtol=0, atol=2e-2)
