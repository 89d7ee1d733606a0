"""Per-rank model-state bytes and per-step communication of ZeroOptimizer against the ZeRO paper.

Memory, measured from the tensors that exist after a step (mixed-precision Adam, K = 12,
bf16 params and gradients, P = Ψ plus alignment padding; plus one 4-byte step counter per bucket):
    stage 0: 2P + 2P + 12P      stage 1: 2P + 2P + 12P/N
    stage 2: 2P + (2 + 12)P/N   stage 3: (2 + 2 + 12)P/N
Communication per step and rank (ring algorithms, fp32 reduce dtype, B = 4P bytes):
    stages 0-2: 2B(N-1)/N (all-reduce = reduce-scatter + all-gather), stage 3: 3B(N-1)/N.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from optim import ZeroOptimizer
from optim.policies import Communication, MixedPrecision
from parallel import accounting
from tests.dist_utils import run_distributed
from tests.models import make_model


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(31, 97), nn.GELU(), nn.Linear(97, 53), nn.GELU(), nn.Linear(53, 29))


def one_step(model: nn.Module, opt: ZeroOptimizer, dtype: torch.dtype) -> None:
    x = torch.randn(4, 31, dtype=dtype)
    opt.backward(model(x).float().pow(2).mean())
    opt.step()
    opt.zero_grad()


def measure_memory(stage: int) -> dict:
    model = mlp()
    psi = sum(p.numel() for p in model.parameters())
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        precision=MixedPrecision(torch.bfloat16, torch.bfloat16),
        communication=Communication(bucket_numel=4000, unit_numel=1000, resident_numel=0),
    )
    one_step(model, opt, torch.bfloat16)
    padded = sum(b.numel for b in opt.buckets)
    return {"psi": psi, "padded": padded, "buckets": len(opt.buckets), **opt.memory_breakdown()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_matches_zero_formulas(stage: int, world: int) -> None:
    for m in run_distributed(measure_memory, world, stage):
        P, N = m["padded"], world
        assert P - m["psi"] <= m["buckets"] * 16 * N + 6 * 16, "padding beyond alignment"
        expected = {
            0: (2 * P, 2 * P, 12 * P),
            1: (2 * P, 2 * P, 12 * P // N),
            2: (2 * P, 2 * P // N, 12 * P // N),
            3: (2 * P // N, 2 * P // N, 12 * P // N),
        }[stage]
        steps = 4 * m["buckets"]  # Adam's fp32 step counter, one scalar per bucket
        assert (m["params"], m["grads"], m["master"] + m["optimizer"] - steps) == expected, m


def measure_comm(stage: int) -> dict:
    model = mlp()
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        communication=Communication(bucket_numel=4000, unit_numel=1000, resident_numel=0),
    )
    one_step(model, opt, torch.float32)  # the first step records the order stage 3 prefetches in
    with accounting.tracking() as log:
        one_step(model, opt, torch.float32)
    return {
        "padded": sum(b.numel for b in opt.buckets),
        "log": log.as_dict(),
        "bytes": log.total_bytes("world"),
        "params": sum(len(b.params) for b in opt.buckets),
    }


def check_in_stats(world: int) -> dict:
    """Stage 3's check-in on its side group, once per forward: 2 int64 per rank, gathered."""
    return {"all_gather_into_tensor": {"calls": 1, "bytes": 16 * (world - 1), "payload_bytes": 16 * world}}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_bytes_match_theory(stage: int, world: int) -> None:
    """2Ψ (3Ψ at stage 3) of gradients and parameters, plus which parameters have a gradient:
    an int32 flag per parameter and one for a hand-set .grad, max-all-reduced after backward
    and at the step; stage 3 also checks in once per forward, on a side group."""
    for m in run_distributed(measure_comm, world, stage):
        B, N = 4 * m["padded"], world
        factor = 3 if stage == 3 else 2
        flags = 2 * 2 * 4 * (m["params"] + 1) * (N - 1) // N
        assert m["bytes"] == factor * B * (N - 1) // N + flags, m["log"]
        assert m["log"].get("world-side") == (check_in_stats(world) if stage == 3 else None)
        ops = set(m["log"]["world"])
        assert ops == (
            {"all_reduce"} if stage == 0 else {"reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"}
        ), ops


def measure_tied_stage3_comm() -> dict:
    model = make_model()
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, stage=3, communication=Communication(unit_numel=500, resident_numel=0)
    )
    idx = torch.randint(0, 37, (4, 8))
    for _ in range(2):  # the second step runs with the prefetch order recorded by the first
        with accounting.tracking() as log:
            opt.backward(model(idx, idx))
            opt.step()
            opt.zero_grad()
    tied = next(b.numel for b in opt.buckets if any(p is model.emb.weight for p in b.params))
    return {
        "padded": sum(b.numel for b in opt.buckets),
        "tied": tied,
        "bytes": log.total_bytes("world", "all_gather_into_tensor") + log.total_bytes("world", "reduce_scatter_tensor"),
        "log": log.as_dict(),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_stage3_prefetch_wastes_nothing_with_tied_weights(world: int) -> None:
    """A tied embedding is gathered once more (for the output head's forward); nothing else
    is gathered twice, even though the head is a second user of the embedding's unit."""
    for m in run_distributed(measure_tied_stage3_comm, world):
        assert m["bytes"] == (3 * m["padded"] + m["tied"]) * 4 * (world - 1) // world, m["log"]
        assert m["log"]["world-side"] == check_in_stats(world)
