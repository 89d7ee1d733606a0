"""What one transformer layer keeps for backward, measured, against the planner's
`layer_activation_bytes` (research/costmodel/memory.py), and the two savings it counts on:
under sequence parallelism the column-parallel linears keep their input's sequence shard
(the backward all-gathers it again), and RoPE keeps no copy of q and k.

A layer's bytes are those `metrics.ActivationMeter` sees the second of two stacked blocks
save in one forward, with bf16 parameters and activations as the trainer runs them: the
storages it adds (the rope tables, shared by all layers, are already counted by the first).
tp = 2 runs on two gloo ranks, each rank measured. The CPU's attention kernels have no
dropout (torch falls back to materializing the scores); a GPU's flash kernel keeps only a
seed for it, which is what the planner counts, so with dropout the attention core runs at
p = 0 here, the dropout of both residual branches as in the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from parallel.random import seed_everything
from parallel.tensor import ColumnParallelLinear, gather_from_sp, tp_rank, tp_size
from parallel.tensor import fp8 as fp8_linear
from research import costmodel, metrics
from research.costmodel.layout import Layout
from research.model import Block, GPTConfig, apply_rope, rope_cos_sin
from tests.dist_utils import run_distributed

S, B, H = 32, 2, 64  # sequence, micro-batch, d_model
BASE = GPTConfig(vocab_size=64, n_layers=2, n_heads=4, d_model=H, max_seq_len=S, vocab_multiple=64)
OPTIONS = {
    "base": {},
    "swiglu": {"activation": "swiglu"},
    "dropout": {"dropout": 0.1},
    "rope": {"position": "rope"},
    "no-bias": {"bias": False},
    "fp8": {"fp8": "tensorwise", "fp8_filter": "none"},
}
LAYOUTS = [(1, False), (2, False), (2, True)]  # (tp, sp)
RECOMPUTE = ("none", "selective", "full")
CASES = [(option, tp, sp, r) for option in OPTIONS for tp, sp in LAYOUTS for r in RECOMPUTE]


def config_of(option: str, recompute: str) -> GPTConfig:
    return dataclasses.replace(BASE, recompute=recompute, **OPTIONS[option])


def predicted(option: str, tp: int, sp: bool, recompute: str) -> float:
    """The planner's bytes of one layer of the case."""
    config = config_of(option, recompute)
    layout = Layout(tp=tp, micro_batch_size=B, recompute=recompute, sequence_parallel=sp, fp8=config.fp8 != "none")
    return costmodel.layer_activation_bytes(config, S, layout)


@contextlib.contextmanager
def without_attention_dropout(p: float) -> Iterator[None]:
    """The attention core without dropout when `p` > 0 (see the module docstring)."""
    if p == 0.0:
        yield
        return
    sdpa = F.scaled_dot_product_attention

    def without_dropout(*args: object, **kwargs: object) -> torch.Tensor:
        assert kwargs.pop("dropout_p") == p
        return sdpa(*args, **kwargs)

    with mock.patch.object(F, "scaled_dot_product_attention", without_dropout):
        yield


def _gathered_forward(self: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """A column-parallel linear that all-gathers its SP input and keeps the gathered tensor."""
    return fp8_linear.linear(gather_from_sp(x, self.group), self.weight, self.bias, self.fp8)


def layer_bytes(config: GPTConfig, group: dist.ProcessGroup | None, sp: bool, gathered: bool = False) -> int:
    """Bytes the second of two blocks saves for backward in one forward; `gathered`: with the
    column-parallel linears keeping their gathered input. The backward runs after."""
    tp = tp_size(group)
    seed_everything(0, tp_rank=tp_rank(group))
    blocks = [Block(config, group, sp).to(torch.bfloat16).train() for _ in range(2)]
    x = torch.randn(S // tp if sp else S, B, H, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(S, config.head_dim, config.rope_theta) if config.position == "rope" else (None, None)
    patch = mock.patch.object(ColumnParallelLinear, "forward", _gathered_forward) if gathered else None
    with patch or contextlib.nullcontext(), without_attention_dropout(config.dropout):
        with metrics.ActivationMeter(blocks) as meter:
            y, _ = blocks[0](x, cos, sin)
            before = meter.current_bytes
            y, _ = blocks[1](y, cos, sin)
            saved = meter.current_bytes - before
        y.float().square().sum().backward()
    return saved


def _column_bitwise(group: dist.ProcessGroup) -> list[str]:
    """The SP column-parallel linear against the same layer keeping its gathered input: the
    output and every gradient bit for bit (bf16, fp32 with and without bias, fp32 weights
    under bf16 autocast)."""
    differ = []
    cases = [(torch.bfloat16, True, False), (torch.float32, True, False), (torch.float32, False, False)]
    for dtype, bias, autocast in [*cases, (torch.float32, True, True)]:
        results = []
        for forward in (ColumnParallelLinear.forward, _gathered_forward):
            torch.manual_seed(5)
            layer = ColumnParallelLinear(H, 3 * H, group=group, bias=bias, sequence_parallel=True).to(dtype)
            if bias:
                torch.nn.init.normal_(layer.bias)
            g = torch.Generator().manual_seed(6 + dist.get_rank())
            x = torch.randn(S // 2, B, H, generator=g).to(dtype).requires_grad_()
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                y = forward(layer, x)
            y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
            grads = [x.grad, layer.weight.grad] + ([layer.bias.grad] if bias else [])
            results.append([y.detach(), *grads])
        what = f"{dtype} bias={bias} autocast={autocast}"
        differ += [f"{what} #{i}" for i, (a, b) in enumerate(zip(*results)) if not torch.equal(a, b)]
    return differ


def _on_rank() -> dict:
    group = dist.group.WORLD
    layers = {(option, sp, r): layer_bytes(config_of(option, r), group, sp) for option, tp, sp, r in CASES if tp == 2}
    gathered = {
        (option, r): layer_bytes(config_of(option, r), group, True, True)
        for option in ("base", "swiglu")
        for r in RECOMPUTE
    }
    return {"layers": layers, "gathered": gathered, "column": _column_bitwise(group)}


@functools.cache
def two_ranks() -> list[dict]:
    return run_distributed(_on_rank, 2, timeout=120)


def measured(option: str, tp: int, sp: bool, recompute: str) -> list[int]:
    """The case's layer bytes on each TP rank."""
    if tp == 1:
        return [layer_bytes(config_of(option, recompute), None, sp)]
    return [rank["layers"][option, sp, recompute] for rank in two_ranks()]


@pytest.mark.parametrize(
    "option, tp, sp, recompute", CASES, ids=[f"{o}-tp{t}-{'sp' if s else 'nosp'}-{r}" for o, t, s, r in CASES]
)
def test_planner_holds_what_a_layer_saves(option: str, tp: int, sp: bool, recompute: str) -> None:
    expected = predicted(option, tp, sp, recompute)
    for saved in measured(option, tp, sp, recompute):
        assert saved == pytest.approx(expected, rel=0.05), f"measured {saved} B, planner {expected:.0f} B"


@pytest.mark.parametrize("option", ["base", "swiglu"])
def test_sequence_parallel_keeps_the_input_shard(option: str) -> None:
    """Keeping each column-parallel linear's sequence shard instead of its all-gathered input
    saves 2·A·sbh(1 - 1/t) per layer (4sbh(1 - 1/t) at 2-byte activations) where the layer
    keeps its activations; full recompute keeps only the layer input either way."""
    drop = 2 * 2 * S * B * H * (1 - 1 / 2)
    for rank in two_ranks():
        for r in RECOMPUTE:
            assert rank["gathered"][option, r] - rank["layers"][option, True, r] == (0 if r == "full" else drop), r


def test_sequence_parallel_linear_is_bitwise_the_gathered_one() -> None:
    for rank in two_ranks():
        assert rank["column"] == []


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_rope_keeps_no_copy(recompute: str) -> None:
    """A RoPE layer keeps exactly what a layer with learned positions keeps."""
    rope, learned = (layer_bytes(config_of(o, recompute), None, False) for o in ("rope", "base"))
    assert rope == learned


def _rope_written_out(x_bHsd: torch.Tensor, cos_sd: torch.Tensor, sin_sd: torch.Tensor) -> torch.Tensor:
    """Pairs (x₁, x₂) = (even, odd) rotated: (x₁cos - x₂sin, x₁sin + x₂cos), differentiated by autograd."""
    x1, x2 = x_bHsd[..., 0::2], x_bHsd[..., 1::2]
    cos, sin = cos_sd.to(x_bHsd.dtype), sin_sd.to(x_bHsd.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_is_bitwise_the_rotation_written_out(dtype: torch.dtype) -> None:
    heads, d = 4, 16
    cos, sin = rope_cos_sin(S, d, 10000.0)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(S, B, heads * 3 * d, generator=g).to(dtype)
    dy = torch.randn(3, B, heads, S, d, generator=g).to(dtype)
    outs, grads = [], []
    for rotate in ("model", "written out"):
        x = qkv.clone().requires_grad_()
        if rotate == "model":
            q, k, v = rearrange(apply_rope(x, cos, sin, heads), "s b (H three d) -> three b H s d", H=heads, three=3)
        else:
            q, k, v = rearrange(x, "s b (H three d) -> three b H s d", H=heads, three=3)
            q, k = _rope_written_out(q, cos, sin), _rope_written_out(k, cos, sin)
        out = torch.stack((q, k, v))
        out.backward(dy)
        outs.append(out.detach())
        grads.append(x.grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
