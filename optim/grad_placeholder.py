"""What `param.grad` holds for a parameter trained by ZeroOptimizer.

The reduced gradient lives in the optimizer's flat buckets, sharded over the data-parallel
ranks at stages 1-3, so no rank has a dense `param.grad` to show. Leaving `.grad` at None
would make ordinary PyTorch code silently wrong (`torch.nn.utils.clip_grad_norm_` would
clip nothing; `model.zero_grad()` could not be told apart from a parameter without a
gradient). Instead each parameter with a gradient holds a `GradPlaceholder`: a tensor with
the parameter's shape and no storage whose operations are answered by the optimizer:

    autograd's `grad += new` (a further backward)  -> the new gradient goes to the bucket
    `linalg_vector_norm(g, p)`, `_foreach_norm`      -> ‖ḡ_param‖_p over all shards (a collective)
    `g.mul_(c)`, `_foreach_mul_`                     -> the parameter's owned gradient × c
    `g.zero_()`, `_foreach_zero_`                    -> the parameter's gradient set to zero

so `torch.nn.utils.clip_grad_norm_` clips exactly and `model.zero_grad()` (which sets `.grad`
to None, or zeroes it) clears exactly what it clears in torch. Any other operation raises
one sentence saying what to use instead.

The tensors in the optimizer's `param_groups` (flat fp32 master shards, one per bucket) show
a placeholder of the whole bucket (`i` None) in the same way, for trainers that clip the
optimizer's parameters: its norm is the bucket's over all shards, its scaling and zeroing
act on the bucket's reduced gradient, and autograd never adds to it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

aten = torch.ops.aten

UNSUPPORTED = (
    "param.grad of a parameter trained by ZeroOptimizer holds no values (the reduced gradient is "
    "sharded in the optimizer's buckets), so {op} cannot run on it; clip with "
    "torch.nn.utils.clip_grad_norm_ or opt.clip_grad_norm_, clear with opt.zero_grad() or "
    "model.zero_grad(), and read gradients with opt.full_grads() (a collective)"
)


class GradOwner(Protocol):
    """The optimizer side of a placeholder: parameter `i` of bucket `k` (i None: the whole bucket)."""

    def grad_norm_of(self, k: int, i: int | None, norm_type: float) -> torch.Tensor: ...

    def scale_grad_of(self, k: int, i: int | None, factor: torch.Tensor | float) -> None: ...

    def zero_grad_of(self, k: int, i: int | None) -> None: ...


class GradPlaceholder(torch.Tensor):
    """`param.grad` of parameter `i` of bucket `k` of `owner`, or with `i` None the `.grad`
    of the bucket's master shard (see module docstring)."""

    owner: GradOwner
    k: int
    i: int | None
    pending: torch.Tensor | None

    @staticmethod
    def __new__(
        cls, owner: GradOwner, k: int, i: int | None, shape: torch.Size, dtype: torch.dtype, device: torch.device
    ) -> GradPlaceholder:
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        self.owner, self.k, self.i, self.pending = owner, k, i, None
        return self

    def take(self) -> torch.Tensor:
        """The gradient autograd added to this placeholder in the current backward."""
        grad, self.pending = self.pending, None
        return grad

    def __repr__(self) -> str:  # type: ignore[override]
        return f"GradPlaceholder(shape={tuple(self.shape)}, dtype={self.dtype}: sharded in ZeroOptimizer)"

    def __deepcopy__(self, memo: dict) -> None:
        return None

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            raise RuntimeError(UNSUPPORTED.format(op=func.__name__))
        return handler(*args, **kwargs)


def _add_(self: GradPlaceholder, other: torch.Tensor, alpha: float = 1) -> GradPlaceholder:
    if alpha != 1 or self.pending is not None or self.i is None:
        raise RuntimeError(UNSUPPORTED.format(op="add_"))
    self.pending = other
    return self


def _norm(
    self: GradPlaceholder, ord: float = 2, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    if dim is not None:
        raise RuntimeError(UNSUPPORTED.format(op="a norm over some dims"))
    norm = self.owner.grad_norm_of(self.k, self.i, float(ord))
    return norm if dtype is None else norm.to(dtype)


def _foreach_norm(tensors: list[torch.Tensor], ord: float = 2, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    return [
        _norm(t, ord, dtype=dtype) if isinstance(t, GradPlaceholder) else torch.linalg.vector_norm(t, ord, dtype=dtype)
        for t in tensors
    ]


def _mul_(self: GradPlaceholder, factor: torch.Tensor | float) -> GradPlaceholder:
    self.owner.scale_grad_of(self.k, self.i, factor)
    return self


def _foreach_mul_(tensors: list[torch.Tensor], factors: Any) -> None:
    per_tensor = factors if isinstance(factors, (list, tuple)) else [factors] * len(tensors)
    for t, f in zip(tensors, per_tensor):
        if isinstance(t, GradPlaceholder):
            _mul_(t, f)
        else:
            t.mul_(f)


def _zero_(self: GradPlaceholder) -> GradPlaceholder:
    self.owner.zero_grad_of(self.k, self.i)
    return self


def _foreach_zero_(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if isinstance(t, GradPlaceholder):
            _zero_(t)
        else:
            t.zero_()


_HANDLERS = {
    aten.add_.Tensor: _add_,
    aten.linalg_vector_norm.default: _norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten.mul_.Tensor: _mul_,
    aten.mul_.Scalar: _mul_,
    aten._foreach_mul_.Tensor: _foreach_mul_,
    aten._foreach_mul_.Scalar: _foreach_mul_,
    aten._foreach_mul_.ScalarList: _foreach_mul_,
    aten._foreach_mul_.List: _foreach_mul_,
    aten.zero_.default: _zero_,
    aten._foreach_zero_.default: _foreach_zero_,
}
