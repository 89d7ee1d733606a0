"""Tensor-parallel layers (Shoeybi et al. 2019) with optional sequence parallelism
(Korthikanti et al. 2022).

Legend: s = sequence, b = batch, h = hidden, v = vocabulary, tp = TP group size,
r = this rank's index in the TP group. A linear layer is Y = X Wᵀ + b with W [out, in].

    ColumnParallelLinear   W split by rows (output features): rank r computes
                           Y_r = X W_rᵀ + b_r, the r-th column block of Y.
                           X enters through f (copy_to_tp), or through g' (all-gather
                           along s) when X is SP-sharded [s/tp, b, in]; then backward
                           all-gathers X again for dW = dYᵀX and keeps only X's shard
                           for it (Korthikanti et al. 2022 §4.2.2).
    RowParallelLinear      W split by columns (input features): rank r computes the
                           partial sum X_r W_rᵀ from its input block X_r; then
                           Y = Σ_r X_r W_rᵀ via g (reduce_from_tp), or ḡ'
                           (reduce_scatter_to_sp) leaving Y SP-sharded [s/tp, b, out];
                           then + b, with b replicated over TP.
    VocabParallelEmbedding rows of E [v, h] split over ranks: rank r looks up the ids
                           in its range, writes 0 for the others; Σ_r via g (or ḡ').

Initialization is independent of tp: every layer draws the FULL tp=1 weight from the
global RNG (``init_method``, default N(0, 0.02²)) and keeps its slice, so the same seed
gives the slices of the same weights at any tp. Biases start at zero.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel import comm, marks
from parallel.tensor import fp8
from parallel.tensor.mappings import (
    _all_gather_dim0,
    _reduce_scatter_dim0,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    group_name,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
    tp_rank,
    tp_size,
)

Group = dist.ProcessGroup | None
InitMethod = Callable[[torch.Tensor], object]

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "default_init",
    "sequence_parallel_grad_sync",
    "shard_of",
]


def default_init(w: torch.Tensor) -> None:
    """N(0, 0.02²) in place, from the global RNG (GPT-2 / Megatron default)."""
    torch.nn.init.normal_(w, mean=0.0, std=0.02)


def shard_of(full: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """A contiguous clone of this rank's 1/tp chunk of ``full`` along ``dim``."""
    tp = tp_size(group)
    if full.size(dim) % tp != 0:
        raise ValueError(f"dim {dim} of size {full.size(dim)} is not divisible by tp={tp}")
    return full.chunk(tp, dim=dim)[tp_rank(group)].clone(memory_format=torch.contiguous_format)


def _divide(name: str, value: int, group: Group) -> int:
    tp = tp_size(group)
    if value % tp != 0:
        raise ValueError(f"{name}={value} is not divisible by tp={tp}")
    return value // tp


def _sharded_weight(shape: tuple[int, int], dim: int, group: Group, init_method) -> nn.Parameter:
    """Materialize the full fp32 tp=1 weight, initialize it, keep this rank's shard."""
    full = torch.empty(shape, dtype=torch.float32)
    (init_method or default_init)(full)
    return nn.Parameter(shard_of(full, dim, group))


# ---------------------------------------------------------------------------
# Gradient sync for TP-replicated parameters under sequence parallelism
# ---------------------------------------------------------------------------


def sequence_parallel_grad_sync(module: nn.Module, name: str, group: Group) -> None:
    """Make the gradient of ``module``'s parameter ``name`` the sum over the TP group of the
    per-rank gradients.

    Under SP a TP-replicated parameter (LayerNorm weight / bias, row-parallel bias) sees
    only this rank's sequence shard, so its full gradient is Σ_r ∂L/∂p computed on
    shard r. The all-reduce runs in a hook on the gradient *before* autograd
    accumulates it into ``param.grad`` (``Tensor.register_hook`` on the leaf), so:
    - each backward's contribution is reduced exactly once, even when several backward
      passes accumulate into ``param.grad`` (gradient accumulation without an optimizer
      that consumes the gradient);
    - it always runs before every ``register_post_accumulate_grad_hook`` (ZeroOptimizer's),
      whatever the order of registration.
    Marks the parameter (``parallel.marks.mark_sequence_parallel``, which also marks it
    replicated over ``group``). A tensor hook lives with its Parameter object, which
    ``copy.deepcopy`` does not copy, so a forward pre-hook on ``module`` (which is copied)
    registers it on any marked parameter that lacks it. Idempotent; a no-op hook at tp == 1.
    Which parameters have their hooks is kept on the module in a `_HookedParams`, which a
    copy (deepcopy, pickle) does not carry over; eagerly the check also compares the parameter
    objects (one assigned anew gets its hook), under torch.compile names alone (an identity
    test would guard each block's graph on its parameters' ids, one graph per block), so
    torch.compile traces the check without breaking the graph and replays a registration.
    """
    marks.mark_sequence_parallel(module, name, group)
    if not module.__dict__.get("_sequence_parallel_hooked"):
        module.__dict__["_sequence_parallel_hooked"] = True
        module.register_forward_pre_hook(_register_grad_sync_hooks)
    _register_grad_sync_hooks(module)


class _HookedParams(dict):
    """(parameter name, group name) -> the parameter given a gradient hook summing over that
    group. A copy starts empty: a tensor's hooks do not travel with its copies."""

    def __deepcopy__(self, memo: dict) -> _HookedParams:
        return _HookedParams()

    def __reduce__(self) -> tuple:
        return (_HookedParams, ())


def _register_grad_sync_hooks(module: nn.Module, *forward_args: object) -> None:
    hooked = module.__dict__.setdefault("_sequence_parallel_hooked_params", _HookedParams())
    for name, m in module.__dict__.get("_param_marks", {}).items():
        p = module._parameters.get(name)
        for group in m.sequence_parallel:
            if p is None or tp_size(group) == 1:
                continue
            key = (name, group_name(group))
            if key in hooked and (torch.compiler.is_compiling() or hooked[key] is p):
                continue
            hooked[key] = p
            p.register_hook(partial(_all_reduce_grad, group=group))


def _all_reduce_grad(grad: torch.Tensor, group: Group) -> torch.Tensor:
    out = grad.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group=group)
    return out


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------


class _TPModule(nn.Module):
    """Holds the TP ``group``; ``copy.deepcopy`` shares the group (a ProcessGroup cannot be
    copied)."""

    group: Group

    def __deepcopy__(self, memo: dict) -> _TPModule:
        memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """Y = g'(X) Wᵀ + b for an SP-sharded X [s/tp, b, in], keeping X's shard, not the
    gathered X, for backward (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication
    with sequence_parallel):

        forward    X_g = all-gather_s(X);  Y = X_g Wᵀ + b
        backward   dX = reduce-scatter_s(dY W);  dW = dYᵀ all-gather_s(X);  db = Σ dY

    The products are those autograd takes for F.linear, in dY's dtype (the autocast one,
    if any), each gradient returned in its input's dtype: the numbers are the same.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.bias_dtype = group, None if bias is None else bias.dtype
        return F.linear(_all_gather_dim0(x, group), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy_2d = dy.reshape(-1, dy.shape[-1])
        x_2d = _all_gather_dim0(x, ctx.group, again=True).view(dy_2d.shape[0], -1).to(dy.dtype)
        dx = dy_2d.mm(weight.to(dy.dtype)).view(*dy.shape[:-1], -1)
        dw = dy_2d.t().mm(x_2d).to(weight.dtype)
        db = None if ctx.bias_dtype is None else dy_2d.sum(0).to(ctx.bias_dtype)
        return _reduce_scatter_dim0(dx.to(x.dtype), ctx.group), dw, db, None


class ColumnParallelLinear(_TPModule):
    """Y = X Wᵀ + b with W [out, in] split by rows: weight [out/tp, in], bias [out/tp].

    x: [s, b, in] replicated, or [s/tp, b, in] with ``sequence_parallel``.
    Returns [s, b, out/tp] (this rank's output columns), or [s, b, out] with ``gather_output``.
    ``fp8``: a recipe of `parallel.tensor.fp8` for the matmul ("none": in x's dtype).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Group,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        fp8: str = "none",
    ) -> None:
        super().__init__()
        out_local = _divide("out_features", out_features, group)
        self.in_features, self.out_features, self.fp8 = in_features, out_features, fp8
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.weight = _sharded_weight((out_features, in_features), 0, group, init_method)
        self.bias = nn.Parameter(torch.zeros(out_local)) if bias else None
        marks.mark_partitioned(self, "weight", 0)
        if bias:
            marks.mark_partitioned(self, "bias", 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.fp8 == "none" and tp_size(self.group) > 1:
            y = _SequenceParallelColumnLinear.apply(x, self.weight, self.bias, self.group)
        else:  # X replicated, or float8 under SP: its matmul keeps the gathered X in 1 byte
            x = gather_from_sp(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
            y = fp8.linear(x, self.weight, self.bias, self.fp8)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}, {self.out_features} (local {self.weight.shape[0]}), "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_TPModule):
    """Y = X Wᵀ + b with W [out, in] split by columns: weight [out, in/tp], bias [out] replicated.

    x: [s, b, in/tp] (``input_is_parallel``) or [s, b, in] replicated (split here).
    Returns [s, b, out] replicated, or [s/tp, b, out] with ``sequence_parallel``.
    ``fp8``: a recipe of `parallel.tensor.fp8` for the matmul ("none": in x's dtype).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Group,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        fp8: str = "none",
    ) -> None:
        super().__init__()
        _divide("in_features", in_features, group)
        self.in_features, self.out_features, self.fp8 = in_features, out_features, fp8
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = _sharded_weight((out_features, in_features), 1, group, init_method)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        marks.mark_partitioned(self, "weight", 1)
        if bias:  # replicated over TP; under SP its gradient is summed over TP
            marks.mark_replicated(self, "bias", group)
            if sequence_parallel:
                sequence_parallel_grad_sync(self, "bias", group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = fp8.linear(x, self.weight, None, self.fp8)  # partial sum X_r W_rᵀ
        y = reduce_scatter_to_sp(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"{self.in_features} (local {self.weight.shape[1]}), {self.out_features}, "
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(_TPModule):
    """E [v, h] split by rows: weight [v/tp, h] holds ids [r·v/tp, (r+1)·v/tp).

    ids_sb: [s, b] token ids (the same on every TP rank).
    Returns [s, b, h] replicated, or [s/tp, b, h] with ``sequence_parallel``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        v_local = _divide("num_embeddings", num_embeddings, group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = tp_rank(group) * v_local
        self.vocab_end = self.vocab_start + v_local
        self.weight = _sharded_weight((num_embeddings, embedding_dim), 0, group, init_method)
        marks.mark_partitioned(self, "weight", 0)

    def forward(self, ids_sb: torch.Tensor) -> torch.Tensor:
        if tp_size(self.group) == 1:
            out_sbh = F.embedding(ids_sb, self.weight)
        else:
            outside = (ids_sb < self.vocab_start) | (ids_sb >= self.vocab_end)
            local_ids = (ids_sb - self.vocab_start).masked_fill(outside, 0)
            out_sbh = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out_sbh, self.group)
        return reduce_from_tp(out_sbh, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, ids [{self.vocab_start}, "
            f"{self.vocab_end}), sequence_parallel={self.sequence_parallel}"
        )
