"""GPT on a dp × tp mesh with ZeroOptimizer trains exactly like the tp = 1, single-process
model with torch.optim.AdamW: same loss curve, same global grad norm (TP-replicated
parameters counted once), same final weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from optim import ZeroOptimizer
from optim.policies import Communication
from parallel import ParallelDims
from parallel.random import seed_everything
from research import costmodel
from research.model import GPT, GPTConfig
from tests.conftest import slow_except
from tests.dist_utils import run_distributed
from tests.test_model_parity import gather_tp, tp_dims

CONFIG = GPTConfig(vocab_size=61, n_layers=2, n_heads=4, d_model=32, max_seq_len=16, vocab_multiple=64)
STEPS, BATCH, LR, CLIP = 10, 8, 3e-3, 0.5
# Adam's first step moves an element by ≈ lr·g/(|g| + eps): an element whose gradient is
# ~1e-8 (a GELU unit this batch barely uses; here blocks.0.mlp.up.weight[78, 12], 4e-8 vs a
# median of 1e-3) turns summation-order rounding into 1e-6-sized weight differences with the
# default eps = 1e-8. eps = 1e-6 and a short LR warm-up (as any real run has) keep such
# elements from amplifying noise.
EPS = 1e-6


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 5)


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.max_seq_len + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    seed_everything(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    losses, norms = [], []
    for ids, labels in global_batches():
        loss = model(ids, labels)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(stage: int, tp: int, sequence_parallel: bool) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    dims = ParallelDims(tp=tp).build()
    seed_everything(0, tp_rank=dims.tp_rank)
    model = GPT(CONFIG, tp_group=dims.tp_group, sequence_parallel=sequence_parallel)
    names = tp_dims(model)
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        process_group=dims.dp_group,
        model_parallel_group=dims.mp_group,
        lr=LR,
        eps=EPS,
        communication=Communication(bucket_numel=3000, unit_numel=2000),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    per_rank = BATCH // dims.dp
    rows = slice(dims.dp_rank * per_rank, (dims.dp_rank + 1) * per_rank)
    losses, norms = [], []
    for ids, labels in global_batches():
        loss = model(ids[rows], labels[rows])
        opt.backward(loss)
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dims.dp_group)
        losses.append(mean.item() / dims.dp)
    full = opt.full_state_dict()
    return losses, norms, gather_tp({k: full[k] for k in names}, names, dims.tp_group)


@pytest.mark.parametrize("stage,sequence_parallel", slow_except([(3, False), (3, True)], [(1, False)]))
def test_dp2_tp2_matches_single_process(stage: int, sequence_parallel: bool) -> None:
    ref_losses, ref_norms, ref_state = reference()
    results = run_distributed(train, 4, stage, 2, sequence_parallel, timeout=300)
    for losses, norms, state in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        for k, v in state.items():
            torch.testing.assert_close(v, ref_state[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_config_counts() -> None:
    """num_params equals the parameters the tp = 1 model holds, for every variant; FLOPs per
    token equal Narayanan et al. 2021's 72·L·h²·(1 + s/6h + V/12Lh) (96·L·h²·(1 + s/6h +
    V/16Lh) with full recompute) for a GELU model with d_ff = 4h."""
    for overrides in ({}, {"position": "rope", "activation": "swiglu", "norm": "rmsnorm", "tie_embeddings": False}):
        config = dataclasses.replace(CONFIG, **overrides)
        assert costmodel.num_params(config) == sum(p.numel() for p in GPT(config).parameters())
    L, h, V, s = CONFIG.n_layers, CONFIG.d_model, CONFIG.padded_vocab, 16
    assert CONFIG.flops_per_token(s) == pytest.approx(72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)))
    full = dataclasses.replace(CONFIG, recompute="full")
    assert full.flops_per_token(s) == pytest.approx(96 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)))


def test_weights_depend_on_init_seed_and_part_only() -> None:
    """Block i is the same whatever the global RNG and however many blocks the model has
    (what building one pipeline stage needs); another init_seed gives other weights."""
    torch.manual_seed(123)
    small = GPT(dataclasses.replace(CONFIG, n_layers=2)).state_dict()
    torch.manual_seed(456)
    big = GPT(dataclasses.replace(CONFIG, n_layers=3)).state_dict()
    assert all(torch.equal(v, big[k]) for k, v in small.items())
    other = GPT(dataclasses.replace(CONFIG, init_seed=1)).state_dict()
    assert not torch.equal(other["blocks.0.attn.qkv.weight"], small["blocks.0.attn.qkv.weight"])
