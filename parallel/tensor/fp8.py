"""Float8 matmuls for the linear layers, with dynamic tensorwise scaling (torchao's
"tensorwise" float8 training recipe; Transformer Engine's current scaling, Micikevicius et al.
2022, "FP8 Formats for Deep Learning").

Each matmul scales its operands by s = F_max / max|t| (the whole tensor, computed in the same
pass: no amax history), casts them to float8 and multiplies with fp32 accumulation:

    forward   Y  = (s_x X)₈ (s_w W)₈ᵀ / (s_x s_w)               e4m3 × e4m3 (F_max 448)
    backward  dX = (s_g G)₈ (s_w W)₈ / (s_g s_w)                 e5m2 × e4m3 (F_max 57344)
              dW = (s_g G)₈ᵀ (s_x X)₈ / (s_g s_x)                e5m2 × e4m3

Backward reuses the forward's float8 X (saved for it: 1 byte per element, half of bf16's)
and casts W again (the same scale: W has not changed), so no float8 copy of a weight is kept
per micro-batch in flight. Under tensor parallelism each rank scales its own shard of W and its own X (a
finer scaling than one amax over the group, with no extra collective). On CUDA the products
are `torch._scaled_mm`; elsewhere the same arithmetic in fp32 (the float8 values times
their scales, fp32 accumulation), since the CPU's `_scaled_mm` is orders of magnitude slower
than its fp32 matmul: the two agree to fp32 rounding (tests/test_fp8.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("none", "tensorwise")
_AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale


def to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t · s as `dtype`, 1/s) with s = F_max / max|t|, saturating at ±F_max. max|t| is one
    pass (`aminmax`); on CUDA the scale-and-cast is compiled into one elementwise kernel: run
    as written it is four passes with fp32 temporaries and costs more than the float8
    matmul it feeds. The scale is computed outside the compiled kernel, so both paths give
    the same bits."""
    t = t.detach()
    low, high = torch.aminmax(t)
    top = torch.finfo(dtype).max
    scale = top / torch.maximum(-low, high).float().clamp(min=_AMAX_FLOOR)
    return (_compiled_scale_cast() if t.is_cuda else scale_cast)(t, scale, top, dtype), scale.reciprocal()


def scale_cast(t: torch.Tensor, scale: torch.Tensor, top: float, dtype: torch.dtype) -> torch.Tensor:
    """t · scale in fp32, saturated at ±top, as `dtype`."""
    return (t.float() * scale).clamp(-top, top).to(dtype)


@functools.cache
def _compiled_scale_cast() -> Callable[[torch.Tensor, torch.Tensor, float, torch.dtype], torch.Tensor]:
    """`scale_cast` through torch.compile, shapes symbolic (a model's linears have many): a
    graph per float8 format and input dtype, far below torch.compile's limit per function
    (past it, the ops would run eagerly again)."""
    return torch.compile(scale_cast, dynamic=True)


def scaled_mm(
    a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor, out: torch.dtype
) -> torch.Tensor:
    """(a · a_inv) @ (b · b_inv) in fp32 accumulation, as `out`: a [M, K] row-major, b [K, N]
    column-major float8 (`torch._scaled_mm`'s layout)."""
    if a.device.type == "cuda":
        return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out)
    return ((a.float() @ b.float()) * (a_inv * b_inv)).to(out)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x8, x_inv = to_float8(x.reshape(-1, x.shape[-1]), E4M3)
        w8, w_inv = to_float8(weight, E4M3)
        ctx.save_for_backward(x8, x_inv, weight)
        ctx.x_shape = x.shape
        y = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x8, x_inv, weight = ctx.saved_tensors
        w8, w_inv = to_float8(weight, E4M3)  # recast: no float8 copy of the weight kept per micro-batch
        g8, g_inv = to_float8(g.reshape(-1, g.shape[-1]), E5M2)
        dx = scaled_mm(g8, w8.t().contiguous().t(), g_inv, w_inv, g.dtype)
        dw = scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), g_inv, x_inv, weight.dtype)
        return dx.view(ctx.x_shape), dw


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str) -> torch.Tensor:
    """F.linear(x, weight, bias) with its matmul in float8 under `recipe` ("none": as is)."""
    if recipe == "none":
        return F.linear(x, weight, bias)
    if recipe != "tensorwise":
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    y = _Float8Linear.apply(x, weight)
    return y if bias is None else y + bias
