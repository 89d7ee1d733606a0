"""Float8 training (`parallel.tensor.fp8`, `--fp8 tensorwise`): the scaled matmul equals
`torch._scaled_mm`, the linear layer's forward and gradients are bf16's within float8's
precision, and a tiny GPT's loss curve in fp8 tracks bf16's over 30 steps, in one process
and at tp 2 × dp 2 under ZeRO-3 (with exact and with float8 parameter gathers, the latter
sending half the bytes)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from parallel.tensor import fp8
from research.config import ConfigError
from research.model import Block, GPTConfig
from tests.dist_utils import run_distributed

E4M3 = torch.float8_e4m3fn


def test_scaled_mm_is_torchs_on_the_cpu() -> None:
    """The fp32 path (CPU) is `torch._scaled_mm`'s arithmetic: equal to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 48, generator=g), torch.randn(16, 48, generator=g) * 5
    (a8,), a_inv = fp8.to_float8(a, E4M3)
    (b8,), b_inv = fp8.to_float8(b, fp8.E5M2)
    ours = fp8.scaled_mm(a8, b8.t(), a_inv, b_inv, torch.float32)
    torchs = torch._scaled_mm(a8, b8.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=torch.float32)
    torch.testing.assert_close(ours, torchs, rtol=1e-6, atol=1e-5)


def test_to_float8_scales_by_the_largest_power_of_two_in_range_and_saturates() -> None:
    t = torch.tensor([[0.5, -2.0, 1.0]])
    (t8,), inv = fp8.to_float8(t, E4M3)
    assert torch.equal(t8.float(), torch.tensor([[64.0, -256.0, 128.0]])) and float(inv) == 2.0**-7
    (zero8,), zero_inv = fp8.to_float8(torch.zeros(1, 3), E4M3)
    assert torch.isfinite(zero_inv) and not zero8.float().any()


@pytest.mark.parametrize("top", [448.0, 57344.0], ids=["e4m3", "e5m2"])
def test_power_of_two_scale_is_the_largest_that_keeps_amax_in_range(top: float) -> None:
    """For amax across 60 binades and at the edges of each: s = 2^k with amax·s ≤ top <
    amax·2s, and 1/s exact."""
    g = torch.Generator().manual_seed(2)
    amax = torch.cat([2.0 ** torch.arange(-30.0, 30.0), torch.rand(500, generator=g).double() * 1e6])
    amax = torch.cat([amax, amax * (1 + 2**-23), amax * (1 - 2**-24), torch.tensor([top, 1.0])]).float()
    for a in amax.tolist():
        scale, inverse = fp8.power_of_two_scale(torch.tensor(a), top)
        s = float(scale)
        assert s == 2.0 ** round(math.log2(s)) and float(inverse) * s == 1.0
        assert a * s <= top < a * 2 * s, (a, s)


def test_a_cast_writes_the_layouts_the_matmuls_read() -> None:
    """The "columns" layout is the transpose, contiguous, of "rows", from the same scale."""
    x = torch.randn(24, 40, dtype=torch.bfloat16) * 3
    (rows, columns), inv = fp8.to_float8(x, fp8.E5M2, "both")
    (alone,), inv_alone = fp8.to_float8(x, fp8.E5M2, "columns")
    assert columns.is_contiguous() and columns.shape == (40, 24) and torch.equal(inv, inv_alone)
    assert torch.equal(columns.view(torch.uint8), rows.t().contiguous().view(torch.uint8))
    assert torch.equal(alone.view(torch.uint8), columns.view(torch.uint8))


def test_linear_forward_and_gradients_are_bf16s_within_float8_precision() -> None:
    """Relative error of Y, dX, dW against the bf16 linear: e4m3 keeps 3 mantissa bits
    (2^-4 relative), e5m2 2; summed over K the errors average out to a few percent."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(32, 64, generator=g) * 0.05).bfloat16().requires_grad_()
    b = torch.zeros(32, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(4, 8, 32, generator=g).bfloat16()
    out = {}
    for recipe in ("none", "tensorwise"):
        y = fp8.linear(x, w, b, recipe)
        dx, dw, db = torch.autograd.grad(y, (x, w, b), grad)
        out[recipe] = (y, dx, dw, db)
    for ref, got in zip(out["none"], out["tensorwise"]):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        error = (got.float() - ref.float()).norm() / ref.float().norm()
        assert error < 0.08, float(error)
    assert torch.equal(out["none"][3], out["tensorwise"][3])  # the bias is not float8


STEPS = 30  # of each loss-tracking run


def _train(base: str, data: str, name: str, argv: list[str]) -> list[float]:
    from experiments.train import run

    out = os.path.join(base, name)
    common = [
        *("--n-layers", "2", "--n-heads", "2", "--d-model", "64", "--max-seq-len", "32", "--seq-len", "32"),
        *("--vocab-multiple", "128", "--global-batch-size", "8", "--steps", str(STEPS), "--lr", "3e-3"),
        *("--warmup-steps", "5", "--precision", "bf16", "--seed", "0", "--wandb", "disabled", "--fp8-filter", "none"),
        *("--log-every", "1000", "--data", data, "--data-cache", os.path.join(base, "cache"), "--out", out),
    ]
    run([*common, *argv])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def _curves(base: str, data: str, layout: list[str], fp8_runs: dict[str, list[str]]) -> dict[str, list[float]]:
    """Loss curves of `layout` in bf16 and, per entry of `fp8_runs`, with --fp8 tensorwise
    and that entry's flags."""
    curves = {"bf16": _train(base, data, "bf16", layout)}
    for name, extra in fp8_runs.items():
        curves[name] = _train(base, data, name, [*layout, "--fp8", "tensorwise", *extra])
    return curves


# The loss of a run in fp8 against bf16 (exact gathers), at every step after the first 10:
# over 50 steps measured within 0.46% (tp 1), 0.51% (tp 2 x dp 2, ZeRO-3) and 1.19% (the
# same with float8 parameter gathers, measured once; the suite checks their bytes and first
# steps below), ending within 0.5%; over the suite's 30 steps within 0.22% and 0.17%, ending
# within 0.13%. The tolerance is 3x the worst of 50 steps, 2% at the end. The curves must
# differ (fp8 really ran).
TRACK_RTOL, FINAL_RTOL = 0.035, 0.02
ZERO3 = ["--tp", "2", "--zero", "3", "--unit-numel", "2000"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "world, layout, fp8_runs",
    [
        (1, ["--zero", "1"], {"fp8": []}),
        (4, ZERO3, {"fp8": []}),
    ],
    ids=["tp1", "tp2-dp2-zero3"],
)
def test_fp8_loss_tracks_bf16(tmp_path, world: int, layout: list[str], fp8_runs: dict[str, list[str]]) -> None:
    data = tmp_path / "text.txt"
    data.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}" for i in range(400)))
    curves = run_distributed(_curves, world, str(tmp_path), str(data), layout, fp8_runs, timeout=540)[0]
    bf16 = curves.pop("bf16")
    assert bf16[-1] < 0.6 * bf16[0]  # it learned
    for name, f8 in curves.items():
        gaps = [abs(a - b) / b for a, b in zip(f8[10:], bf16[10:])]
        assert 1e-4 < max(gaps) < TRACK_RTOL, f"{name}: largest relative gap {max(gaps):.4f}"
        assert f8[-1] <= bf16[-1] * (1 + FINAL_RTOL), (name, f8[-1], bf16[-1])


def _gather_bytes(base: str, data: str) -> dict[str, float]:
    """dp all-gather bytes per step of 2-step tp 2 × dp 2 ZeRO-3 runs: bf16, and fp8 with
    float8 parameter gathers."""
    out = {}
    layout = ["--tp", "2", "--zero", "3", "--unit-numel", "2000", "--steps", "2"]
    for name, extra in (("bf16", []), ("fp8", ["--fp8", "tensorwise", "--qwz-block", "256", "--qwz-float8"])):
        _train(base, data, name, [*layout, *extra])
        with open(os.path.join(base, name, "summary.json")) as f:
            summary = json.load(f)
        out[name] = summary["comm_per_step"]["dp"]["ops"]["all_gather_into_tensor"]["bytes"]
        with open(os.path.join(base, name, "metrics.jsonl")) as f:
            out[f"{name}_loss"] = [json.loads(line)["loss"] for line in f][-1]
    return out


@pytest.mark.timeout(300)
def test_float8_parameter_gathers_send_half_the_bytes(tmp_path) -> None:
    """ZeRO-3 all-gathers float8 e4m3 blocks (1 byte + a 4-byte scale per 256) instead of
    bf16 (2 bytes): (1 + 4/256)/2 of the bytes, plus each shard's last block padded to 256
    elements (these units' shards are about 1000 elements: measured 0.529); the loss after
    two steps stays bf16's."""
    data = tmp_path / "text.txt"
    data.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(200)))
    sent = run_distributed(_gather_bytes, 4, str(tmp_path), str(data), timeout=280)[0]
    assert (1 + 4 / 256) / 2 <= sent["fp8"] / sent["bf16"] < 0.55, sent
    assert sent["fp8_loss"] == pytest.approx(sent["bf16_loss"], rel=TRACK_RTOL)  # the gathered weights are right


def test_fp8_needs_bf16_and_sizes_of_16() -> None:
    from research.config import ParallelConfig, validate_fp8
    from research.model import GPTConfig

    every = {"fp8": "tensorwise", "fp8_filter": "none"}
    with pytest.raises(ConfigError, match="use it with --precision bf16"):
        validate_fp8(GPTConfig(d_model=64, **every), ParallelConfig(), "fp32")
    with pytest.raises(ConfigError, match="divisible by 16"):
        validate_fp8(GPTConfig(d_model=40, n_heads=4, **every), ParallelConfig(), "bf16")
    with pytest.raises(ConfigError, match="--micro-batch-size divisible by 16"):
        validate_fp8(GPTConfig(d_model=64, **every), ParallelConfig(), "bf16", tokens=24)
    validate_fp8(GPTConfig(d_model=64, **every), ParallelConfig(tp=2), "bf16")


def test_the_linears_too_small_to_gain_stay_in_bf16() -> None:
    """`fp8.pays` on a rank's [out, in] weight: no float8 where in ≤ 2048, out ≤ 1024, or in ≤ 4096
    with out ≤ 2048. The 1.31B GPT (h 2048, f 8192) casts its MLP down projection alone; an 8B-shaped
    block (h 4096, SwiGLU f 14336) all four, and at tp 8 its up projection alone; with
    --fp8-filter none every linear is cast; a model where none pays is refused with what to pass."""
    from research.config import ParallelConfig, validate_fp8
    from research.model import GPTConfig

    assert (
        fp8.pays(4097, 1025)
        and not fp8.pays(4097, 1024)
        and not fp8.pays(2049, 1025)
        and not fp8.pays(2048, 8192)
        and not fp8.pays(8192, 1024)
    )
    assert not fp8.pays(4096, 2048) and fp8.pays(4097, 2048) and fp8.pays(4096, 2049)
    gpt13 = GPTConfig(n_layers=26, n_heads=16, d_model=2048, fp8="tensorwise")
    assert gpt13.float8_linears(1) == {"down"}
    assert dataclasses.replace(gpt13, fp8_filter="none").float8_linears(1) == {"qkv", "proj", "up", "down"}
    block8b = GPTConfig(n_heads=32, d_model=4096, d_ff=14336, activation="swiglu", fp8="tensorwise")
    assert block8b.float8_linears(1) == {"qkv", "proj", "up", "down"}
    assert block8b.float8_linears(8) == {"up"}  # down: 1792 inputs per rank
    model = Block(dataclasses.replace(gpt13, n_layers=1, max_seq_len=16), None, False)
    recipes = {n: m.fp8 for n, m in model.named_modules() if hasattr(m, "fp8")}
    assert recipes == {"attn.qkv": "none", "attn.proj": "none", "mlp.up": "none", "mlp.down": "tensorwise"}
    with pytest.raises(ConfigError, match=r"would cast no linear layer.*--fp8-filter none"):
        validate_fp8(GPTConfig(d_model=64, fp8="tensorwise"), ParallelConfig(), "bf16")


def test_fp8_is_refused_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    """ROCm's _scaled_mm on MI300 takes the fnuz float8 types: refused in one sentence."""
    from research.config import ParallelConfig, validate_fp8
    from research.model import GPTConfig

    monkeypatch.setattr(torch.version, "hip", "6.3.42131", raising=False)
    with pytest.raises(ConfigError, match="train in bf16 on ROCm"):
        validate_fp8(GPTConfig(d_model=64, fp8="tensorwise", fp8_filter="none"), ParallelConfig(), "bf16")


@pytest.mark.cuda
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs CUDA")
@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
def test_compiled_cast_on_cuda_is_the_eager_one(dtype: torch.dtype) -> None:
    """On CUDA the cast runs compiled (a reduction and one elementwise kernel): the same
    float8 bits, layouts and scale as the eager ops, for shapes that share one compiled graph."""
    for shape in [(4096, 2048), (2048, 8192), (333, 64)]:
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 7
        for layout in ("rows", "columns", "both"):
            got, inv = fp8.to_float8(x, dtype, layout)
            want, want_inv = fp8.cast_float8(x, dtype, layout)
            assert torch.equal(inv, want_inv)
            for a, b in zip(got, want, strict=True):
                assert a.stride() == b.stride() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.slow
def test_a_compiled_float8_block_is_as_close_to_fp32_as_the_eager_one() -> None:
    """torch.compile of a bf16 block with tensorwise float8 linears (inductor on the CPU): the
    float8 casts trace into the block's graph. The bits differ from eager (inductor keeps fp32
    between fused elementwise ops, which eager rounds to bf16 after each, and a gradient's
    e5m2 cast, 2 mantissa bits, turns such a difference into a step of 12-25 %), so the
    tolerance is stated against the fp32 block: the compiled block's output and gradients are
    as close to it as the eager float8 block's (within 1.5x its error, and 10 % outright)."""
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=256, n_layers=1, n_heads=4, d_model=64, max_seq_len=32, fp8="tensorwise", fp8_filter="none"
    )
    block = Block(cfg, None, False)
    exact = Block(dataclasses.replace(cfg, fp8="none"), None, False)
    exact.load_state_dict(block.state_dict())
    block = block.to(torch.bfloat16)
    x = torch.randn(32, 2, 64, requires_grad=True)

    def run(module: torch.nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        x.grad = None
        y, _ = module(x.to(dtype))
        y.float().square().sum().backward()
        return [y.detach().float(), x.grad.float(), *(p.grad.float() for p in module.parameters())]

    want, eager = run(exact, torch.float32), run(block, torch.bfloat16)
    block.compile_computation()
    for got, ref, fp32 in zip(run(block, torch.bfloat16), eager, want, strict=True):
        error, eager_error = float((got - fp32).norm() / fp32.norm()), float((ref - fp32).norm() / fp32.norm())
        assert error <= max(1.5 * eager_error, 1e-3) and error < 0.1, (error, eager_error)
