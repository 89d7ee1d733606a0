"""The grouped GEMM of a set of experts: rows of `x` sorted by expert, expert e's rows times
its own matrix, y[rows of e] = x[rows of e] · W[e].

`torch._grouped_mm` runs it as one kernel where it exists and the shapes allow (every row
16-byte aligned); otherwise one matmul per expert. Both are exact per row. The backward
is written out so that it runs on contiguous gradients (the kernel rejects the expanded
ones autograd may hand it): dx = g · W[e]ᵀ per expert's rows, dW[e] = x[rows of e]ᵀ · g[rows of e].
"""

from __future__ import annotations

import torch

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """`torch._grouped_mm` exists and accepts these operands (16-byte aligned rows)."""
    align = 16 // x.element_size()
    return (
        hasattr(torch, "_grouped_mm")
        and x.dtype in GROUPED_DTYPES
        and x.dtype == w.dtype
        and x.shape[-1] % align == 0
        and w.shape[-1] % align == 0
        and x.shape[0] > 0
    )


def _offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def _forward(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    if _kernel_fits(x, w):
        return torch._grouped_mm(x, w, offs=_offsets(counts, x.device))
    out = x.new_empty(x.shape[0], w.shape[-1])
    for e, rows in enumerate(torch.split(torch.arange(x.shape[0], device=x.device), counts)):
        if len(rows):
            out[rows] = x[rows] @ w[e]
    return out


def _weight_grad(x: torch.Tensor, g: torch.Tensor, counts: list[int], like: torch.Tensor) -> torch.Tensor:
    if _kernel_fits(x, like) and g.shape[-1] % (16 // g.element_size()) == 0:
        return torch._grouped_mm(x.t(), g, offs=_offsets(counts, x.device))
    dw = torch.zeros_like(like)
    for e, (xe, ge) in enumerate(zip(torch.split(x, counts), torch.split(g, counts))):
        if len(xe):
            dw[e] = xe.t() @ ge
    return dw


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        return _forward(x, w, counts)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:  # type: ignore[override]
        x, w = ctx.saved_tensors
        g = g.contiguous()
        dx = _forward(g, w.transpose(-2, -1).contiguous(), ctx.counts) if ctx.needs_input_grad[0] else None
        dw = _weight_grad(x, g, ctx.counts, w) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[n, i] rows sorted by expert (`counts[e]` rows of expert e, sum = n) times w [E, i, o]
    -> [n, o]."""
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mm: counts {counts} do not split {x.shape[0]} rows over {w.shape[0]} experts")
    return _GroupedMM.apply(x, w, counts)
