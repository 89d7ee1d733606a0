"""The grouped GEMM of a set of experts: rows of `x` sorted by expert, expert e's rows times
its own matrix, y[rows of e] = x[rows of e] · W[e].

`torch._grouped_mm` runs it as one call where it exists and the shapes allow (every row
16-byte aligned); otherwise one matmul per expert, concatenated. Both are exact per row and
differentiate natively; the gradient reaching `torch._grouped_mm` is made contiguous first,
since its backward rejects the expanded gradients autograd may hand it.
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


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.contiguous()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[n, i] rows sorted by expert (`counts[e]` rows of expert e, sum = n) times w [E, i, o]
    -> [n, o]."""
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mm: counts {counts} do not split {x.shape[0]} rows over {w.shape[0]} experts")
    if _kernel_fits(x, w):
        offsets = torch.tensor(counts, dtype=torch.int64, device=x.device).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offsets))
    return torch.cat([xe @ w[e] for e, xe in enumerate(torch.split(x, counts))])
