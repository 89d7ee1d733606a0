"""GPT under tensor (+ sequence) parallelism equals the tp = 1 model, and its collectives
per transformer layer are what Megatron's analysis says."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from parallel import accounting
from parallel.marks import NO_MARKS, param_marks
from parallel.random import seed_everything
from research.model import GPT, GPTConfig
from tests.conftest import slow_except
from tests.dist_utils import run_distributed

BASE = GPTConfig(vocab_size=61, n_layers=2, n_heads=4, d_model=32, max_seq_len=16, vocab_multiple=64)
VARIANTS = {
    "learned-gelu-layernorm-tied": {},
    "rope-swiglu-rmsnorm-untied-window": {
        "position": "rope",
        "activation": "swiglu",
        "norm": "rmsnorm",
        "tie_embeddings": False,
        "sliding_window": 5,
    },
}
RECOMPUTE = ["none", "selective", "full"]


def tp_dims(model: torch.nn.Module) -> dict[str, int | None]:
    """name -> the dim along which TP splits the parameter (None: replicated)."""
    marks = param_marks(model)
    return {name: marks.get(p, NO_MARKS).partition_dim for name, p in model.named_parameters(remove_duplicate=False)}


def gather_tp(tensors: dict[str, torch.Tensor], dims: dict[str, int | None], group) -> dict[str, torch.Tensor]:
    """Full tensors from this rank's TP shards."""
    out = {}
    for name, t in tensors.items():
        dim = dims[name]
        if dim is None:
            out[name] = t.clone()
            continue
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        out[name] = torch.cat(parts, dim)
    return out


def batch(seed: int = 0, b: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, BASE.vocab_size, (b, BASE.max_seq_len + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :3] = -100
    return ids[:, :-1], labels


def loss_and_grads(config: GPTConfig, sequence_parallel: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    seed_everything(0)
    model = GPT(
        config, tp_group=None if not dist.is_initialized() else dist.group.WORLD, sequence_parallel=sequence_parallel
    )
    loss = model(*batch())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if dist.is_initialized():
        grads = gather_tp(grads, tp_dims(model), None)
    return loss.item(), grads


def tp_variants() -> list[tuple[str, bool, str, float, dict]]:
    results = []
    for name, overrides in VARIANTS.items():
        for sp in (False, True):
            for recompute in RECOMPUTE:
                config = dataclasses.replace(BASE, recompute=recompute, **overrides)
                loss, grads = loss_and_grads(config, sp)
                results.append((name, sp, recompute, loss, grads))
    return results


@pytest.mark.parametrize("tp", slow_except([2], [4]))
def test_tp_equals_tp1(tp: int) -> None:
    results = run_distributed(tp_variants, tp, timeout=300)
    for i, (name, sp, recompute, loss, grads) in enumerate(results[0]):
        ref_loss, ref_grads = loss_and_grads(dataclasses.replace(BASE, recompute=recompute, **VARIANTS[name]))
        where = f"{name} sp={sp} recompute={recompute}"
        assert loss == pytest.approx(ref_loss, rel=1e-5), where
        assert all(rank[i][3] == loss for rank in results), f"{where}: the loss differs across TP ranks"
        for k, g in ref_grads.items():
            torch.testing.assert_close(
                grads[k], g, rtol=1e-5, atol=1e-6, msg=lambda m, where=where, k=k: f"{where} {k}: {m}"
            )


def collectives_per_layer(sequence_parallel: bool, recompute: str) -> dict:
    """Collective calls of one forward + backward of a 1-layer and a 2-layer GPT; their
    difference is one transformer layer's."""
    counts = []
    for n_layers in (1, 2):
        config = dataclasses.replace(BASE, n_layers=n_layers, recompute=recompute)
        seed_everything(0)
        model = GPT(config, tp_group=dist.group.WORLD, sequence_parallel=sequence_parallel)
        with accounting.tracking() as log:
            model(*batch()).backward()
        counts.append(
            {op: log.calls(op=op) for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")}
        )
    return {op: counts[1][op] - counts[0][op] for op in counts[0]}


# Under SP each TP-replicated parameter of a layer (2 norms × weight and bias, 2 row-parallel
# biases) also gets its gradient summed over TP: 6 small all-reduces per layer, on top of
# the 4 all-gathers + 4 reduce-scatters of activations, and the QKV and MLP inputs gathered
# again in backward (+2): their linears keep only the sequence shard for dW.
SP_GRAD_SYNC = 6


@pytest.mark.parametrize(
    "sequence_parallel,recompute,expected",
    [
        (False, "none", {"all_reduce": 4, "all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}),
        (True, "none", {"all_reduce": SP_GRAD_SYNC, "all_gather_into_tensor": 6, "reduce_scatter_tensor": 4}),
        (False, "selective", {"all_reduce": 4, "all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}),
        (True, "selective", {"all_reduce": SP_GRAD_SYNC, "all_gather_into_tensor": 6, "reduce_scatter_tensor": 4}),
        # full recompute re-runs the block's forward in backward, but torch's non-reentrant
        # checkpoint stops once the last tensor backward needs is rebuilt (the MLP's input):
        # without SP the attention output's all-reduce runs again (+1); with SP both
        # all-gathers (+2) and the attention output's reduce-scatter (+1), not the MLP's
        (False, "full", {"all_reduce": 5, "all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}),
        (True, "full", {"all_reduce": SP_GRAD_SYNC, "all_gather_into_tensor": 8, "reduce_scatter_tensor": 5}),
    ],
)
def test_collectives_per_layer(sequence_parallel: bool, recompute: str, expected: dict) -> None:
    for counts in run_distributed(collectives_per_layer, 2, sequence_parallel, recompute):
        assert counts == expected


def logits_and_dropout() -> tuple[torch.Tensor, list[float]]:
    """Gathered logits of the tp model; losses of a dropout model on each TP rank."""
    seed_everything(0)
    model = GPT(BASE, tp_group=dist.group.WORLD)
    logits = model(batch()[0]).detach()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, logits.contiguous())
    seed_everything(0, tp_rank=dist.get_rank())
    noisy = GPT(dataclasses.replace(BASE, dropout=0.3), tp_group=dist.group.WORLD, sequence_parallel=True)
    loss = noisy(*batch())
    loss.backward()
    losses = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach())
    return torch.cat(parts, -1), [x.item() for x in losses]


def test_logits_and_dropout_under_tp() -> None:
    seed_everything(0)
    ref = GPT(BASE)(batch()[0]).detach()
    logits, losses = run_distributed(logits_and_dropout, 2)[0]
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-6)
    assert losses[0] == losses[1] and losses[0] == losses[0], "TP ranks must agree on the loss"
