"""Autograd-aware communication for tensor (TP) and sequence (SP) parallelism.

Megatron-style TP (Shoeybi et al. 2019) shards a linear layer's weight over the TP
group; the activations then move between three layouts, written here for the
sequence-first activation x_sbh = [seq, batch, hidden] and tp = group size:

    replicated         every rank holds the whole x_sbh
    TP-sharded         rank r holds x_sbh[..., r·h/tp : (r+1)·h/tp]   (the last dim)
    SP-sharded         rank r holds x_sbh[r·s/tp : (r+1)·s/tp]        (dim 0; Korthikanti
                       et al. 2022 keep LayerNorm / dropout activations this way)

Each function below moves a tensor between layouts in forward and does the adjoint
(transpose) move in backward, so that autograd gives the gradients of the unsharded
model. Forward / backward pairs:

    copy_to_tp             f   identity         | all-reduce (sum)
    reduce_from_tp         g   all-reduce (sum) | identity
    scatter_to_tp              split last dim   | all-gather last dim
    gather_from_tp             all-gather last  | split last dim
    scatter_to_sp              split dim 0      | all-gather dim 0
    gather_from_sp         g'  all-gather dim 0 | reduce-scatter dim 0
    reduce_scatter_to_sp   ḡ'  reduce-scatter 0 | all-gather dim 0

(`f` and `g` are the operators of the Megatron paper, Fig. 3; g' / ḡ' replace f / g
under sequence parallelism, Korthikanti et al. Fig. 5.)

With tp == 1 every function is the identity and issues no collective. The collectives
are the operators of ``parallel.functional`` (traced into a compiled block's graph, counted
by ``accounting.tracking()`` at run time) and never write into an autograd input or
incoming gradient: autograd may share those tensors (a residual branch hands the same
gradient to both summands).

``group`` is the TP process group; None means the default (world) group, or a group of
size 1 when torch.distributed is not initialized (a single-process model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import functional


@dataclass(frozen=True)
class ShapeGroup:
    """A stand-in TP group of `size` ranks seen from rank `rank`: layers built with it have the
    shapes of that TP rank (on the meta device, say, for the planner) without torch.distributed;
    no collective may run on it."""

    size: int
    rank: int = 0


Group = dist.ProcessGroup | ShapeGroup | None

__all__ = [
    "ShapeGroup",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "group_name",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_sp",
    "scatter_to_tp",
    "tp_rank",
    "tp_size",
]


def tp_size(group: Group) -> int:
    """Size of the TP group (1 when torch.distributed is not initialized)."""
    if isinstance(group, ShapeGroup):
        return group.size
    return dist.get_world_size(group) if dist.is_initialized() else 1


def tp_rank(group: Group) -> int:
    """This rank's index inside the TP group (0 when torch.distributed is not initialized)."""
    if isinstance(group, ShapeGroup):
        return group.rank
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_name(group: Group) -> str:
    """The name `parallel.functional`'s operators find ``group`` by (the default group's for
    None; a `ShapeGroup`, on which nothing runs, its repr)."""
    if isinstance(group, ShapeGroup):
        return repr(group)
    return (group or dist.group.WORLD).group_name


# ---------------------------------------------------------------------------
# Plain (non-autograd) primitives
# ---------------------------------------------------------------------------


def _chunk(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's contiguous 1/tp chunk of ``x`` along ``dim``."""
    tp = tp_size(group)
    if x.size(dim) % tp != 0:
        raise ValueError(f"dim {dim} of size {x.size(dim)} (shape {tuple(x.shape)}) is not divisible by tp={tp}")
    return x.chunk(tp, dim=dim)[tp_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Σ_r x_r, in a new tensor."""
    return functional.all_reduce(x, group_name(group))


def _all_gather_dim0(x: torch.Tensor, group: Group, again: bool = False) -> torch.Tensor:
    """cat_r x_r along dim 0: [n, ...] -> [tp·n, ...] (`again`: `functional.all_gather_dim0`'s)."""
    return functional.all_gather_dim0(x, group_name(group), again)


def _all_gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    """cat_r x_r along the last dim: [..., n] -> [..., tp·n] (gathered along dim 0, then moved)."""
    tp = tp_size(group)
    stacked = _all_gather_dim0(x.unsqueeze(0), group)  # [tp, ..., n]
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], tp * x.size(-1))


def _reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Rank r's chunk of Σ_r' x_r' along dim 0: [tp·n, ...] -> [n, ...]."""
    tp = tp_size(group)
    if x.size(0) % tp != 0:
        raise ValueError(f"dim 0 of size {x.size(0)} is not divisible by tp={tp}")
    return functional.reduce_scatter_dim0(x, group_name(group))


# ---------------------------------------------------------------------------
# Autograd functions: forward op | backward op (the adjoint)
# ---------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """f: identity | all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce | identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ScatterToTP(torch.autograd.Function):
    """split last dim | all-gather last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _chunk(x, -1, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_last(dy, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    """all-gather last dim | split last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _chunk(dy, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    """split dim 0 | all-gather dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _chunk(x, 0, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_dim0(dy, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    """g': all-gather dim 0 | reduce-scatter dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter_dim0(dy, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    """ḡ': reduce-scatter dim 0 | all-gather dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_dim0(dy, ctx.group), None


# ---------------------------------------------------------------------------
# Public functions (identity at tp == 1)
# ---------------------------------------------------------------------------


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f: y = x forward; dx = Σ_r dy_r backward. Enters a TP region (before a column-parallel linear)."""
    return x if tp_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g: y = Σ_r x_r forward; dx = dy backward. Leaves a TP region (after a row-parallel linear)."""
    return x if tp_size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """y = x[..., r·n/tp : (r+1)·n/tp] forward; dx = cat_r dy_r (last dim) backward."""
    return x if tp_size(group) == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """y = cat_r x_r (last dim) forward; dx = dy[..., r·n : (r+1)·n] backward."""
    return x if tp_size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_sp(x_sbh: torch.Tensor, group: Group) -> torch.Tensor:
    """y = x[r·s/tp : (r+1)·s/tp] forward; dx = cat_r dy_r (dim 0) backward."""
    return x_sbh if tp_size(group) == 1 else _ScatterToSP.apply(x_sbh, group)


def gather_from_sp(x_sbh: torch.Tensor, group: Group) -> torch.Tensor:
    """g': y = cat_r x_r (dim 0) forward; dx = chunk_r(Σ_r' dy_r') backward.

    Used under SP before a column-parallel linear: each rank's [s, b, h] output feeds
    only its own output columns, so the input gradient is a sum over ranks."""
    return x_sbh if tp_size(group) == 1 else _GatherFromSP.apply(x_sbh, group)


def reduce_scatter_to_sp(x_sbh: torch.Tensor, group: Group) -> torch.Tensor:
    """ḡ': y = chunk_r(Σ_r' x_r') (dim 0) forward; dx = cat_r dy_r (dim 0) backward.

    Used under SP after a row-parallel linear: the partial sums are reduced and the
    result is left sharded over the sequence."""
    return x_sbh if tp_size(group) == 1 else _ReduceScatterToSP.apply(x_sbh, group)
