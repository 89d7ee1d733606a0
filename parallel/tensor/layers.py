"""Tensor-parallel layers (Shoeybi et al. 2019) with optional sequence parallelism
(Korthikanti et al. 2022).

Legend: s = sequence, b = batch, h = hidden, v = vocabulary, tp = TP group size,
r = this rank's index in the TP group. A linear layer is Y = X Wᵀ + b with W [out, in].

    ColumnParallelLinear   W split by rows (output features): rank r computes
                           Y_r = X W_rᵀ + b_r, the r-th column block of Y.
                           X enters through f (copy_to_tp), or through g' (gather_from_sp)
                           when X is SP-sharded [s/tp, b, in].
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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from parallel import comm
from parallel.tensor.mappings import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
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
    "tp_partition_dim",
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


_partition_dims: WeakIdKeyDictionary = WeakIdKeyDictionary()


def tp_partition_dim(param: torch.Tensor) -> int | None:
    """The dim along which TP splits ``param`` (its tp = 1 tensor is the concatenation of
    the TP ranks' tensors along it), or None when every TP rank holds all of it."""
    return _partition_dims.get(param)


def _mark_partitioned(param: torch.Tensor | None, dim: int) -> None:
    if param is not None:
        _partition_dims[param] = dim


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

_synced: WeakIdKeyDictionary = WeakIdKeyDictionary()


def sequence_parallel_grad_sync(param: torch.Tensor, group: Group) -> None:
    """Make ``param``'s gradient the sum over the TP group of the per-rank gradients.

    Under SP a TP-replicated parameter (LayerNorm weight / bias, row-parallel bias) sees
    only this rank's sequence shard, so its full gradient is Σ_r ∂L/∂p computed on
    shard r. The all-reduce runs in a hook on the gradient *before* autograd
    accumulates it into ``param.grad`` (``Tensor.register_hook`` on the leaf), so:
    - each backward's contribution is reduced exactly once, even when several backward
      passes accumulate into ``param.grad`` (gradient accumulation without an optimizer
      that consumes the gradient);
    - it always runs before every ``register_post_accumulate_grad_hook`` (ZeroOptimizer's),
      whatever the order of registration.
    Also marks ``param`` replicated over ``group`` (``comm.mark_replicated``) for the
    grad norm. Idempotent per (param, group); a no-op hook at tp == 1.
    """
    comm.mark_replicated(param, group)
    groups = _synced.get(param, ())
    if any(g is group for g in groups) or tp_size(group) == 1:
        return
    _synced[param] = (*groups, group)

    def all_reduce_grad(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(out, group=group)
        return out

    param.register_hook(all_reduce_grad)


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------


class _TPModule(nn.Module):
    """Holds the TP ``group``; ``copy.deepcopy`` shares the group (a ProcessGroup cannot be
    copied) and re-applies the partition / replication marks and SP grad hooks, which live
    with the Parameter objects and are not copied with them."""

    group: Group

    def _register_marks(self) -> None:
        pass

    def __deepcopy__(self, memo: dict) -> _TPModule:
        memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        new._register_marks()
        return new


class ColumnParallelLinear(_TPModule):
    """Y = X Wᵀ + b with W [out, in] split by rows: weight [out/tp, in], bias [out/tp].

    x: [s, b, in] replicated, or [s/tp, b, in] with ``sequence_parallel``.
    Returns [s, b, out/tp] (this rank's output columns), or [s, b, out] with ``gather_output``.
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
    ) -> None:
        super().__init__()
        out_local = _divide("out_features", out_features, group)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.weight = _sharded_weight((out_features, in_features), 0, group, init_method)
        self.bias = nn.Parameter(torch.zeros(out_local)) if bias else None
        self._register_marks()

    def _register_marks(self) -> None:
        _mark_partitioned(self.weight, 0)
        _mark_partitioned(self.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sp(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)
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
    ) -> None:
        super().__init__()
        _divide("in_features", in_features, group)
        self.in_features, self.out_features = in_features, out_features
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = _sharded_weight((out_features, in_features), 1, group, init_method)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._register_marks()

    def _register_marks(self) -> None:
        """The weight is split along its input dim; the bias is replicated over TP, and
        under SP its gradient is summed over TP."""
        _mark_partitioned(self.weight, 1)
        if self.bias is not None:
            comm.mark_replicated(self.bias, self.group)
            if self.sequence_parallel:
                sequence_parallel_grad_sync(self.bias, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = F.linear(x, self.weight)  # partial sum X_r W_rᵀ
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(y, self.group)
        else:
            y = reduce_from_tp(y, self.group)
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
        self._register_marks()

    def _register_marks(self) -> None:
        _mark_partitioned(self.weight, 0)

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
