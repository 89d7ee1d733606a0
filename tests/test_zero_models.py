"""ZeroOptimizer on models from other libraries: torch.nn.TransformerEncoder and a
HuggingFace GPT-2, against single-process torch.optim.AdamW.

Attention key biases have an analytically zero gradient (softmax is invariant to adding
the same number to every score), so their "gradient" is rounding noise that Adam turns
into ±lr steps; the encoder is built without biases and GPT-2's fused QKV bias is frozen.
For the same reason the encoder regresses onto a target: the mean square of a LayerNorm
output alone hardly depends on the layers below it.

The reference runs in a process like the ranks' (one thread) and accumulates the gradient
of each rank's rows scaled by 1/world, as DDP averages it: a full-batch backward, or
matmuls split over more threads, sum in another order, and Adam turns that rounding
difference of a near-zero gradient element into a visible step difference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from optim import ZeroOptimizer
from optim.policies import Communication
from tests.conftest import slow_except
from tests.dist_utils import run_distributed

STEPS, BATCH, SEQ, WORLD = 6, 8, 8, 2


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "encoder":
        layer = nn.TransformerEncoderLayer(24, 4, 40, dropout=0.0, batch_first=True, bias=False)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    import transformers

    config = transformers.GPT2Config(
        vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    for block in model.transformer.h:
        block.attn.c_attn.bias.requires_grad_(False)
    return model


def loss_of(name: str, model: nn.Module, rows: slice, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    if name == "encoder":
        x, y = torch.randn(2, BATCH, SEQ, 24, generator=g)[:, rows]
        out = model(x, is_causal=True, mask=nn.Transformer.generate_square_subsequent_mask(SEQ))
        return (out - y).pow(2).mean()
    ids = torch.randint(0, 61, (BATCH, SEQ), generator=g)[rows]
    return model(input_ids=ids, labels=ids).loss


def train(name: str, stage: int | None) -> dict[str, torch.Tensor]:
    """stage None: the single-process reference (every rank's rows, gradients averaged);
    else ZeRO on this rank's rows."""
    model = build(name)
    params = [p for p in model.parameters() if p.requires_grad]
    if stage is None:
        opt, ranks, scale = torch.optim.AdamW(params, lr=1e-2), range(WORLD), 1 / WORLD
    else:
        opt = ZeroOptimizer(
            model,
            torch.optim.AdamW,
            stage=stage,
            lr=1e-2,
            communication=Communication(bucket_numel=3000, unit_numel=1000),
        )
        ranks, scale = [dist.get_rank()], 1.0
    for step in range(STEPS):
        for rank in ranks:
            rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
            (loss_of(name, model, rows, step) * scale).backward()
        opt.step()
        opt.zero_grad()
    return opt.full_state_dict() if stage is not None else model.state_dict()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", slow_except(["encoder"], ["gpt2"]))
def test_models_from_other_libraries(name: str, stage: int) -> None:
    ref = run_distributed(train, 1, name, None)[0]
    got = run_distributed(train, WORLD, name, stage, timeout=180)[0]
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
