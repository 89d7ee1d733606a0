"""ZeroOptimizer on expert parameters (`parallel.marks.mark_expert`): each is reduced over
exactly the ranks holding the same experts and averaged over every data-parallel rank, at
every stage; the global norm counts every expert once; ZeRO++ hpZ / qgZ are refused."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from optim import ZeroOptimizer
from optim.policies import Communication, ZeroPlusPlus
from parallel import ParallelDims, marks
from tests.conftest import slow_except
from tests.dist_utils import run_distributed

SMALL = Communication(bucket_numel=64, unit_numel=16, resident_numel=0)  # several buckets and stage-3 units


class Experts(nn.Module):
    """A dense weight and this rank's experts, marked as `research.moe.MoE` marks them."""

    def __init__(self, groups) -> None:
        super().__init__()
        self.dense = nn.Parameter(torch.zeros(3, 4))
        self.experts = nn.Parameter(torch.zeros(2, 4, 5))
        marks.mark_expert(self, "experts", groups.ep, groups.shard, groups.replicate)

    def forward(self, scale: float) -> torch.Tensor:
        return scale * (self.dense.sum() + self.experts.sum())


def _two_to_the_rank(stage: int, dp_shard: int | None) -> dict:
    """Every gradient element of rank r is 2**r."""
    dims = ParallelDims(ep=2, dp_shard=dp_shard).build()
    model = Experts(dims.expert_groups)
    opt = ZeroOptimizer(
        model,
        torch.optim.SGD,
        stage=stage,
        process_group=dims.dp_shard_group,
        replicate_group=dims.dp_replicate_group,
        communication=SMALL,
        lr=0.0,
    )
    model(2.0 ** dist.get_rank()).backward()
    grads = opt.full_grads()
    return {
        "dense": grads["dense"],
        "experts": grads["experts"],
        "norm": float(opt.clip_grad_norm_(math.inf)),
        "same_experts": dist.get_process_group_ranks(dims.ep_shard_group)
        + (dist.get_process_group_ranks(dims.dp_replicate_group) if dims.dp_replicate_group else []),
    }


@pytest.mark.parametrize("dp_shard", [None, 2], ids=["plain", "hybrid"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_gradients_are_reduced_over_the_ranks_holding_them(stage: int, dp_shard: int | None) -> None:
    """dp 4, ep 2: the experts of ranks {0, 2} and {1, 3} are different experts. After the
    reduction a dense gradient is Σ_r 2**r / 4 and an expert's Σ over its own ranks / 4 —
    not the dense sum (gradients too large by ep, or mixed across experts, are what the
    anchors' users report)."""
    results = run_distributed(_two_to_the_rank, 4, stage, dp_shard)
    for rank, r in enumerate(results):
        holders = sorted(set(r["same_experts"]) | {rank})
        assert holders == [rank % 2, rank % 2 + 2]
        assert torch.equal(r["dense"], torch.full((3, 4), 15 / 4))
        assert torch.equal(r["experts"], torch.full((2, 4, 5), sum(2.0**h for h in holders) / 4))
        # every element once: 12 dense ones, and each rank pair's 40 expert elements
        expected = math.sqrt(12 * (15 / 4) ** 2 + 40 * (5 / 4) ** 2 + 40 * (10 / 4) ** 2)
        assert r["norm"] == pytest.approx(expected, rel=1e-6)


def _refused(hpz: bool, qgz_bits: int | None) -> str:
    dims = ParallelDims(ep=2).build()
    try:
        ZeroOptimizer(
            Experts(dims.expert_groups),
            torch.optim.SGD,
            stage=3,
            zero_plus_plus=ZeroPlusPlus(hpz=hpz, qgz_bits=qgz_bits),
            lr=0.1,
        )
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize("hpz, qgz_bits", [(True, None), (False, 8)])
def test_hpz_and_qgz_are_refused_for_experts(hpz: bool, qgz_bits: int | None) -> None:
    for message in run_distributed(_refused, 2, hpz, qgz_bits):
        assert "drop hpz / qgz_bits for a model with experts" in message


def _expert_grads(stage: int, ep: int) -> dict:
    """One step's reduced gradients of an MoE GPT under ZeroOptimizer at `stage`, every rank
    on its own tokens, experts split over `ep` ranks; the experts of all ep ranks gathered."""
    from research.model import GPT, GPTConfig

    dims = ParallelDims(ep=ep).build()
    config = GPTConfig(
        vocab_size=64, n_layers=2, n_heads=2, d_model=16, max_seq_len=8, moe_experts=4, vocab_multiple=64
    )
    model = GPT(config, dims.tp_group, expert_groups=dims.expert_groups)
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, process_group=dims.dp_group, communication=SMALL)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(ids[:, :-1], ids[:, 1:]).backward()
    grads = opt.full_grads()
    for name in [n for n in grads if ".experts." in n]:
        parts = [torch.empty_like(grads[name]) for _ in range(ep)]
        if ep > 1:
            dist.all_gather(parts, grads[name].contiguous(), group=dims.ep_group)
        else:
            parts = [grads[name]]
        grads[name] = torch.cat(parts)
    return {"grads": grads, "norm": float(opt.clip_grad_norm_(math.inf))}


@pytest.mark.parametrize("stage", slow_except([3], [0, 1, 2]))
def test_expert_gradients_at_ep_1_and_ep_n_are_equal(stage: int) -> None:
    """DeepSpeed's TestExpertWeightGradWithZero, here at every stage: the reduced gradients
    of every parameter (experts gathered over ep) and the global norm at ep 2 and 4 equal
    those at ep 1 on the same 4 ranks and tokens."""
    reference = run_distributed(_expert_grads, 4, stage, 1)[0]
    for ep in (2, 4):
        r = run_distributed(_expert_grads, 4, stage, ep)[0]
        assert r["grads"].keys() == reference["grads"].keys()
        for name, g in reference["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        assert r["norm"] == pytest.approx(reference["norm"], rel=1e-6)
