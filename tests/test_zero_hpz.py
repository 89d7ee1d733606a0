"""ZeRO++ hpZ (`ZeroOptimizer(stage=3, zero_plus_plus=ZeroPlusPlus(hpz=True),
node_groups=ParallelDims.dp_shard_node_groups)`): after a unit's first gather in a step each
rank keeps 1/k of it (k = shard ranks per node), and the later gathers of the step stay
inside the node. Exact in fp32 (the same values travel), so the run equals torch; bytes per
group and the extra memory follow the paper's formulas."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optim import ZeroOptimizer
from optim.policies import Communication, ZeroPlusPlus
from parallel import ParallelDims, accounting
from tests.dist_utils import run_distributed
from tests.models import reference_run
from tests.test_zero_memory_comm import mlp
from tests.test_zero_parity import assert_matches
from tests.zero_runs import zero_train

pytestmark = pytest.mark.slow

STEPS, BATCH, MICRO, LR = 10, 16, 2, 1e-2
SMALL = {"communication": Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)}
NODES_OF_2 = {"ranks_per_node": 2}


@pytest.mark.parametrize("dims", [NODES_OF_2, {**NODES_OF_2, "dp_shard": 2}, {"ranks_per_node": 1}])
@pytest.mark.parametrize("use_no_sync", [False, True])
def test_hpz_matches_torch(dims: dict, use_no_sync: bool) -> None:
    """4 ranks: one shard group over 2 nodes of 2 (k = 2); 2 replicas of shard groups inside
    a node (no secondary partition needed: the node group is the shard group); 4 nodes of 1
    (k = 1: each rank keeps whole units from forward to the step)."""
    out = run_distributed(
        zero_train,
        4,
        3,
        STEPS,
        BATCH,
        MICRO,
        lr=LR,
        zero_kwargs={**SMALL, "zero_plus_plus": ZeroPlusPlus(hpz=True)},
        use_no_sync=use_no_sync,
        dims=dims,
    )
    ref = reference_run(STEPS, BATCH, MICRO, 4, torch.optim.AdamW, lr=LR)
    for result in out:
        assert_matches(result, ref)


def _one_step(hpz: bool) -> dict:
    """Two micro-batches (four gathers of each unit) of a 4-rank ZeRO-3 step over 2 nodes of 2."""
    dims = ParallelDims(ranks_per_node=2).build()
    model = mlp()
    kwargs = {"stage": 3, "communication": Communication(bucket_numel=4000, unit_numel=1000, resident_numel=0)}
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, node_groups=dims.dp_shard_node_groups, zero_plus_plus=ZeroPlusPlus(hpz=hpz), **kwargs
    )
    x = torch.randn(2, 4, 31)
    before = opt.memory_breakdown()["params"]
    with accounting.tracking() as log:
        with opt.no_sync():
            opt.backward(model(x[0]).pow(2).mean())
        opt.backward(model(x[1]).pow(2).mean())
    held = opt.memory_breakdown()["params"]
    opt.step()
    return {
        "log": log.as_dict(),
        "padded": sum(b.numel for b in opt.buckets),
        "params": (before, held, opt.memory_breakdown()["params"]),
        "node_group": dist.get_process_group_ranks(dims.dp_shard_node_groups[0]),
    }


@pytest.mark.timeout(120)
def test_hpz_bytes_and_memory() -> None:
    """S padded elements, fp32, N = 4 over 2 nodes of k = 2. Without hpZ the four gathers
    (forward and backward of 2 micro-batches) each send 4S(N−1)/N in the shard group; with
    it only the first does, the other three send 4S(k−1)/k in the node group. Memory: the
    shards 4S/N plus the slices 4S/k from the first gather until the step."""
    for plain, hpz in zip(run_distributed(_one_step, 4, False), run_distributed(_one_step, 4, True)):
        s, n, k = hpz["padded"], 4, 2
        assert plain["log"]["world"]["all_gather_into_tensor"]["bytes"] == 4 * 4 * s * (n - 1) // n
        assert hpz["log"]["world"]["all_gather_into_tensor"]["bytes"] == 4 * s * (n - 1) // n
        assert hpz["log"]["dp_shard_node"]["all_gather_into_tensor"]["bytes"] == 3 * 4 * s * (k - 1) // k
        assert plain["params"] == (4 * s // n,) * 3
        assert hpz["params"] == (4 * s // n, 4 * s // n + 4 * s // k, 4 * s // n)
        assert len(hpz["node_group"]) == k


def _refused(kwargs: dict) -> str:
    dims = ParallelDims(ranks_per_node=2).build()
    try:
        ZeroOptimizer(
            mlp(),
            torch.optim.AdamW,
            node_groups=dims.dp_shard_node_groups,
            zero_plus_plus=ZeroPlusPlus(hpz=True),
            **kwargs,
        )
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_hpz_is_refused_outside_stage_3() -> None:
    (message, _) = run_distributed(_refused, 2, {"stage": 2})
    assert "needs stage=3" in message, message


def _swapped_node_groups() -> str:
    dims = ParallelDims(ranks_per_node=2).build()
    node, cross = dims.dp_shard_node_groups
    try:
        ZeroOptimizer(
            mlp(), torch.optim.AdamW, stage=3, node_groups=(cross, node), zero_plus_plus=ZeroPlusPlus(hpz=True)
        )
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_node_groups_that_do_not_split_the_shard_group_are_refused_on_every_rank() -> None:
    """Swapped, they fit ranks 0 and 3 and not 1 and 2: every rank raises the sentence, none waits."""
    messages = run_distributed(_swapped_node_groups, 4)
    assert all("do not split the shard group of 4" in m for m in messages), messages
