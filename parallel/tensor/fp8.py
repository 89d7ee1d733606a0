"""Float8 matmuls for the linear layers, with dynamic tensorwise scaling (torchao's
"tensorwise" float8 training recipe; Transformer Engine's current scaling, Micikevicius et al.
2022, "FP8 Formats for Deep Learning").

Each matmul scales its operands by s = 2^k, the largest power of two with s · max|t| ≤ F_max
(the whole tensor, computed in the same pass: no amax history; a power of two, so scaling
and the matmul's unscaling are exact, and the scale is the same bits on every device),
casts them to float8 and multiplies with fp32 accumulation:

    forward   Y  = (s_x X)₈ (s_w W)₈ᵀ / (s_x s_w)               e4m3 × e4m3 (F_max 448)
    backward  dX = (s_g G)₈ (s_w W)₈ / (s_g s_w)                 e5m2 × e4m3 (F_max 57344)
              dW = (s_g G)₈ᵀ (s_x X)₈ / (s_g s_x)                e5m2 × e4m3

`torch._scaled_mm` takes its first operand row-major and its second column-major, so each
cast writes the layouts its matmuls read in the same pass (X and G both ways, W row-major
forward and transposed backward) instead of copying float8 tensors to transpose them.
Backward reuses the forward's float8 Xᵀ (saved for it: 1 byte per element, half of bf16's)
and casts W again (the same scale: W has not changed), so no float8 copy of a weight is kept
per micro-batch in flight. Under tensor parallelism each rank scales its own shard of W and
its own X (a finer scaling than one amax over the group, with no extra collective). On CUDA
each cast (amax, scale, cast, layouts) is one compiled graph and the products are
`torch._scaled_mm`; elsewhere the same arithmetic eagerly, in fp32 for the products (the
float8 values times their scales, fp32 accumulation), since the CPU's `_scaled_mm` is
orders of magnitude slower than its fp32 matmul: the two agree to fp32 rounding
(tests/test_fp8.py).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("none", "tensorwise")
Layout = Literal["rows", "columns", "both"]
_AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale
_MANTISSA_BITS = 23  # float32
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1


def power_of_two_scale(amax: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(2^k, 2^-k) for the largest k with amax · 2^k ≤ top, from the float32 exponent and
    mantissa fields of amax and top (integer arithmetic: no rounding anywhere)."""
    (top_bits,) = struct.unpack("<i", struct.pack("<f", top))
    bits = amax.float().clamp(min=_AMAX_FLOOR).view(torch.int32)
    exponent, mantissa = bits >> _MANTISSA_BITS, bits & _MANTISSA_MASK
    k = (top_bits >> _MANTISSA_BITS) - exponent - (mantissa > (top_bits & _MANTISSA_MASK)).int()
    k = k.clamp(-126, 126)  # 2^k a normal float32 (only a non-finite amax reaches the ends)
    return ((k + 127) << _MANTISSA_BITS).view(torch.float32), ((127 - k) << _MANTISSA_BITS).view(torch.float32)


def cast_float8(t: torch.Tensor, dtype: torch.dtype, layout: Layout) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((t · s as `dtype`, saturated at ±F_max) in `layout`, 1/s) for the 2-D t, s from
    `power_of_two_scale`: "rows" the cast as t is laid out, "columns" its transpose made
    contiguous ([K, M] row-major: as an operand, `.t()` of it is column-major), "both" the two."""
    top = torch.finfo(dtype).max
    scale, inverse = power_of_two_scale(t.abs().amax(), top)
    rows = (t.float() * scale).clamp(-top, top).to(dtype)
    if layout == "rows":
        return (rows,), inverse
    columns = rows.t().contiguous()  # only where a matmul reads it: eagerly it is a copy
    return ((columns,) if layout == "columns" else (rows, columns)), inverse


def to_float8(
    t: torch.Tensor, dtype: torch.dtype, layout: Layout = "rows"
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """`cast_float8` of t (detached), compiled on CUDA: run as written it is several passes
    with fp32 temporaries, more than the float8 matmul it feeds; compiled, one reduction
    and one elementwise kernel writing every layout asked for. The scale's integer
    arithmetic makes both paths give the same bits."""
    t = t.detach()
    return (_compiled_cast() if t.is_cuda else cast_float8)(t, dtype, layout)


@functools.cache
def _compiled_cast() -> Callable[[torch.Tensor, torch.dtype, Layout], tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """`cast_float8` through torch.compile, shapes symbolic (a model's linears have many): a
    graph per float8 format, layout and input dtype (four for a bf16 model), below
    torch.compile's limit per function (past it, the ops would run eagerly again)."""
    return torch.compile(cast_float8, dynamic=True)


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
        (x8, x8_t), x_inv = to_float8(x.reshape(-1, x.shape[-1]), E4M3, "both")
        (w8,), w_inv = to_float8(weight, E4M3, "rows")
        ctx.save_for_backward(x8_t, x_inv, weight)
        ctx.x_shape = x.shape
        y = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x8_t, x_inv, weight = ctx.saved_tensors
        (w8_t,), w_inv = to_float8(weight, E4M3, "columns")  # recast: no float8 weight kept per micro-batch
        (g8, g8_t), g_inv = to_float8(g.reshape(-1, g.shape[-1]), E5M2, "both")
        dx = scaled_mm(g8, w8_t.t(), g_inv, w_inv, g.dtype)
        dw = scaled_mm(g8_t, x8_t.t(), g_inv, x_inv, weight.dtype)
        return dx.view(ctx.x_shape), dw


def pays(in_features: int, out_features: int) -> bool:
    """Whether a float8 matmul of a [out, in] weight is faster than the bf16 one it replaces:
    not when in ≤ 2048, out ≤ 1024, or in ≤ 4096 with out ≤ 2048 (torchao's thresholds,
    measured on the H100 with compiled casts: below them the casts, amax and scaling cost
    more than the faster matmul saves). The sizes are a rank's own shard under TP."""
    small = in_features <= 2048 or out_features <= 1024 or (in_features <= 4096 and out_features <= 2048)
    return not small


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str) -> torch.Tensor:
    """F.linear(x, weight, bias) with its matmul in float8 under `recipe` ("none": as is)."""
    if recipe == "none":
        return F.linear(x, weight, bias)
    if recipe != "tensorwise":
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    y = _Float8Linear.apply(x, weight)
    return y if bias is None else y + bias
