"""Hybrid sharding (ZeroOptimizer with a replicate group; ParallelDims(dp_shard=...)):
parity with single-process torch.optim, bytes per group against the formulas, memory per
rank equal to plain ZeRO over the shard group, checkpoints across layouts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optim import ZeroOptimizer
from optim.policies import Communication
from parallel import ParallelDims, accounting
from tests.dist_utils import run_distributed
from tests.models import reference_run
from tests.test_zero_memory_comm import mlp, one_step
from tests.test_zero_parity import assert_matches
from tests.zero_runs import zero_train

pytestmark = pytest.mark.slow

STEPS, BATCH, MICRO, LR = 10, 16, 2, 1e-2
SMALL = {"communication": Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("use_no_sync", [False, True])
def test_two_replicas_of_two_shards_match_torch(stage: int, use_no_sync: bool) -> None:
    """dp 4 = 2 replicas × 2 shards; with `use_no_sync` False every micro-batch is reduced,
    so a replica's second reduction carries the first (only the first replica keeps it)."""
    out = run_distributed(
        zero_train,
        4,
        stage,
        STEPS,
        BATCH,
        MICRO,
        lr=LR,
        zero_kwargs=SMALL,
        use_no_sync=use_no_sync,
        dims={"dp_shard": 2},
    )
    ref = reference_run(STEPS, BATCH, MICRO, 4, torch.optim.AdamW, lr=LR)
    for rank_result in out:
        assert_matches(rank_result, ref)


def _bytes_and_memory(stage: int) -> dict:
    """A step of the 2 × 2 hybrid run under `accounting.tracking()` (after one that records stage
    3's prefetch order), the bucket sizes, and the memory of the hybrid optimizer and of
    plain ZeRO over the shard group alone."""
    dims = ParallelDims(dp_shard=2, ranks_per_node=2).build()
    kwargs = {"stage": stage, "communication": Communication(bucket_numel=4000, unit_numel=1000, resident_numel=0)}
    plain = ZeroOptimizer(mlp(), torch.optim.AdamW, process_group=dims.dp_shard_group, **kwargs)
    model = mlp()
    groups = {"process_group": dims.dp_shard_group, "replicate_group": dims.dp_replicate_group}
    opt = ZeroOptimizer(model, torch.optim.AdamW, **groups, **kwargs)
    one_step(model, opt, torch.float32)
    with accounting.tracking() as log:
        one_step(model, opt, torch.float32)
    plain.state_dict()  # creates its optimizer state, as a step would
    return {
        "log": log.as_dict(),
        "padded": sum(b.numel for b in opt.buckets),
        "params": sum(len(b.params) for b in opt.buckets),
        "memory": (opt.memory_breakdown(), plain.memory_breakdown()),
        "crosses": [
            dims.crosses_nodes(dist.get_process_group_ranks(g)) for g in (dims.dp_shard_group, dims.dp_replicate_group)
        ],
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_per_group_and_memory_follow_the_formulas(stage: int) -> None:
    """fp32 (4 bytes), a shard group of N = 2 inside a node, R = 2 replicas across nodes. For
    buckets of S elements in all: reduce-scatter 4S(N−1)/N in the shard group; all-reduce of
    the S/N shards, 2·4(S/N)(R−1)/R, across replicas; the parameters all-gathered in the shard
    group, 4S(N−1)/N (stages 1-2 after the step; stage 3 twice, in forward and in backward). Plus, across replicas too, the two all-reduces of a flag per
    parameter (int32, P + 1 of them) that agree on which parameters have a gradient."""
    out = run_distributed(_bytes_and_memory, 4, stage)
    n = r = 2
    for result in out:
        assert result["crosses"] == [False, True]
        hybrid, plain = result["memory"]
        assert hybrid == plain
        total = result["padded"]
        log = result["log"]
        flags = 2 * (2 * 4 * (result["params"] + 1) * (r - 1) // r)
        assert log["dp_shard"]["reduce_scatter_tensor"]["bytes"] == 4 * total * (n - 1) // n
        assert log["dp_replicate"].keys() == {"all_reduce"}
        assert log["dp_replicate"]["all_reduce"]["bytes"] == 2 * 4 * (total // n) * (r - 1) // r + flags
        gathered = 2 * total if stage == 3 else total
        assert log["dp_shard"]["all_gather_into_tensor"]["bytes"] == 4 * gathered * (n - 1) // n


@pytest.mark.parametrize("first, second", [((3, 2), (2, None)), ((1, None), (3, 2))])
def test_checkpoint_resumes_across_hybrid_and_plain_layouts(first: tuple, second: tuple, tmp_path) -> None:
    """Saved (torch.distributed.checkpoint) after 4 steps under one (stage, dp_shard), resumed
    under another: the replicas' identical shards are written once and the run goes on as
    the uninterrupted one."""
    (stage_a, shard_a), (stage_b, shard_b) = first, second
    common = {"lr": LR, "zero_kwargs": SMALL}
    run_distributed(
        zero_train, 4, stage_a, STEPS, BATCH, MICRO, save=(4, str(tmp_path)), dims={"dp_shard": shard_a}, **common
    )
    losses, state = run_distributed(
        zero_train, 4, stage_b, STEPS, BATCH, MICRO, load=str(tmp_path), dims={"dp_shard": shard_b}, **common
    )[0]
    ref_losses, ref_state = reference_run(STEPS, BATCH, MICRO, 4, torch.optim.AdamW, lr=LR)
    assert_matches((losses, state), (ref_losses[4:], ref_state))
