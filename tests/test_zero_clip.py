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
from parallel import marks
from tests.conftest import slow_except
from tests.dist_utils import dp_by_mp_groups, run_distributed
from tests.models import batches, make_model


def norm_with_marks(stage: int) -> float:
    rank = dist.get_rank()
    dp, mp = dp_by_mp_groups()
    model = make_model()
    for name, p in model.named_parameters():
        if p.ndim == 1:
            marks.mark_replicated(model, name, mp)
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


# ---- clipping "the optimizer's parameters", as Lightning, Fabric and others do ----------------
SMALL = Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)  # several buckets and units


def optimizer_tensors(opt: ZeroOptimizer) -> list[torch.Tensor]:
    return [t for g in opt.param_groups for t in g["params"]]


def norms_through_param_groups(dims: dict | None) -> dict:
    """On 4 ranks (plain, or hybrid 2 shards × 2 replicas with `dims`), at each stage, after
    one backward on this rank's quarter of the batch: torch's clip_grad_norm_ over the
    optimizer's param_groups (L2 and ∞) next to the optimizer's own norm and the norms of its
    gathered gradients; then the error it raises after a backward under no_sync() alone."""
    from parallel import ParallelDims

    rank = dist.get_rank()
    groups = {}
    if dims is not None:
        layout = ParallelDims(**dims).build()
        groups = {"process_group": layout.dp_shard_group, "replicate_group": layout.dp_replicate_group}
    idx, tgt = batches(1, 16)[0]
    rows = slice(4 * rank, 4 * rank + 4)
    out = {}
    for stage in range(4):
        model = make_model()
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, communication=SMALL, **groups)
        opt.backward(model(idx[rows], tgt[rows]))
        grads = opt.full_grads()
        out[stage] = {
            "l2": float(torch.nn.utils.clip_grad_norm_(optimizer_tensors(opt), 1e9)),
            "inf": float(torch.nn.utils.clip_grad_norm_(optimizer_tensors(opt), 1e9, norm_type="inf")),
            "optimizer": float(opt.clip_grad_norm_(1e9)),
            "gathered_l2": float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values()))),
            "gathered_inf": float(max(g.abs().max() for g in grads.values())),
            "buckets": len(opt.buckets),
        }
        opt.zero_grad()
        with opt.no_sync():
            opt.backward(model(idx[rows], tgt[rows]))
        try:
            torch.nn.utils.clip_grad_norm_(optimizer_tensors(opt), 1.0)
            out[stage]["unsynced"] = "no error"
        except RuntimeError as e:
            out[stage]["unsynced"] = str(e)
    return out


@pytest.mark.parametrize("dims", [None, {"dp_shard": 2}], ids=["plain", "hybrid"])
def test_clip_grad_norm_over_param_groups_is_the_global_norm(dims: dict | None) -> None:
    """torch.nn.utils.clip_grad_norm_ over `optimizer.param_groups` (the flat master shards,
    which are what Lightning's and Fabric's clipping reach) gives the global norm, L2 and ∞,
    at every stage, plain and hybrid, on every rank: never the 0.0 of tensors without
    `.grad`; before the gradients were reduced it names the missing synced backward."""
    for rank in run_distributed(norms_through_param_groups, 4, dims):
        for stage, got in rank.items():
            assert got["buckets"] > 2, stage
            assert got["l2"] == pytest.approx(got["gathered_l2"], rel=1e-5), stage
            assert got["l2"] == pytest.approx(got["optimizer"], rel=1e-6), stage
            assert got["inf"] == pytest.approx(got["gathered_inf"], rel=1e-6), stage
            assert "never reduced" in got["unsynced"], stage


@pytest.mark.parametrize("dims", slow_except([None], [{"dp_shard": 2}]))
def test_clipping_param_groups_trains_like_torch(dims: dict | None) -> None:
    """Clipping (active) with clip_grad_norm_ over the optimizer's param_groups scales the real
    gradients: 4 ranks, 2 micro-batches, 4 steps at each stage equal one torch process clipping
    its model's parameters (losses and weights, fp32)."""
    from tests.models import reference_run
    from tests.zero_runs import zero_train

    ref_losses, ref_weights = reference_run(4, 16, 2, 4, clip=0.5, lr=3e-3)
    for stage in range(4):
        runs = run_distributed(
            zero_train, 4, stage, 4, 16, 2, clip=0.5, clip_param_groups=True, dims=dims, lr=3e-3,
            zero_kwargs={"communication": SMALL},
        )  # fmt: skip
        for losses, weights in runs:
            assert losses == pytest.approx(ref_losses, rel=1e-5), stage
            for k, v in ref_weights.items():
                torch.testing.assert_close(
                    weights[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k, s=stage: f"{s} {k}: {m}"
                )


def clip_under_model_parallelism() -> str:
    """The 2 × 2 layout of `norm_with_marks`, clipped through param_groups: its error."""
    dp, mp = dp_by_mp_groups()
    model = make_model()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, process_group=dp, model_parallel_group=mp)
    idx, tgt = batches(1, 8)[0]
    opt.backward(model(idx, tgt))
    try:
        torch.nn.utils.clip_grad_norm_(optimizer_tensors(opt), 1.0)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_clipping_param_groups_under_model_parallelism_names_the_optimizers_clip() -> None:
    for message in run_distributed(clip_under_model_parallelism, 4):
        assert "clip with optimizer.clip_grad_norm_(max_norm)" in message
