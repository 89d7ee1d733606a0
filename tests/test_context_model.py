"""The GPT under context parallelism: each cp rank's tokens keep their true positions and
their own next-token labels at every chunk boundary, and, called with whole sequences as
without cp, the loss averaged over the cp ranks (in eval, with ignored labels spread
unevenly) and the logits of its tokens are one process's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from parallel import ParallelDims
from parallel.context import positions
from research.model import GPT, IGNORE_INDEX, GPTConfig
from tests.conftest import slow_except
from tests.dist_utils import run_distributed

CONFIG = GPTConfig(vocab_size=97, n_layers=2, n_heads=4, d_model=32, max_seq_len=64)


@pytest.mark.parametrize("ring, a2a", [(1, 2), (2, 1), (4, 1), (2, 2)])
def test_every_token_keeps_its_own_next_token_label(ring: int, a2a: int) -> None:
    """Labels shifted with the whole sequence, then split like the ids: at every chunk
    boundary (and everywhere) a token's label is the token that follows it."""
    stream = torch.arange(1000, 1000 + 33)
    ids, labels = stream[:-1][None], stream[1:][None]
    for g in range(ring):
        for i in range(a2a):
            where = positions(32, ring, g, a2a, i)
            assert torch.equal(labels[:, where], ids[:, where] + 1)
            assert torch.equal(ids[:, where] - 1000, where[None])


def _loss_on_ranks(cp_a2a: int, position: str, window: int | None) -> dict:
    config = dataclasses.replace(CONFIG, position=position, sliding_window=window)
    dims = ParallelDims(cp=dist.get_world_size(), cp_a2a=cp_a2a).build("cpu")
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 64))
    labels = torch.randint(0, config.vocab_size, (2, 64))
    labels[0, :20] = IGNORE_INDEX  # ignored tokens held unevenly by the cp ranks
    tp = dims.tp_group  # one rank (None would be the world)
    single, parallel = GPT(config, tp).eval(), GPT(config, tp, context=dims.context).eval()
    ctx = dims.context
    with torch.no_grad():
        want_loss, want_logits = single(ids, labels), single(ids)
        loss, logits = parallel(ids, labels), parallel(ids)  # whole sequences in, as without cp
        with pytest.raises(ValueError, match="pass the labels of the whole sequences"):
            parallel(ids, ctx.shard(labels))
    mean = loss.clone()
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / ctx.size, want_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(logits, ctx.shard(want_logits), rtol=1e-5, atol=1e-6)
    return {"mode": ctx.mode, "loss": float(mean / ctx.size), "want": float(want_loss)}


@pytest.mark.parametrize(
    "world, cp_a2a, position, window",
    slow_except(
        [(2, 1, "rope", None)],
        [(2, 2, "learned", None), (4, 2, "rope", 20), (4, 1, "learned", 20), (4, 4, "rope", None)],
    ),
)
def test_eval_loss_and_logits_under_cp_equal_one_process(world: int, cp_a2a: int, position: str, window) -> None:
    results = run_distributed(_loss_on_ranks, world, cp_a2a, position, window)
    assert {r["mode"] for r in results} == {{1: "ring", world: "all-to-all"}.get(cp_a2a, "hybrid")}
