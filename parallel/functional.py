"""Functional collectives as custom operators, for the collectives inside a transformer
block (tensor, sequence and Ulysses context parallelism).

Each returns a new tensor and names its group by ``ProcessGroup.group_name``, so
torch.compile traces it into the block's graph instead of breaking the graph there; each
is opaque to the compiler, so the compiled graph calls ``parallel.comm`` at run time and
every call is counted (``accounting.tracking()``) and noted (the flight recorder) as it
is eagerly. Callers hold the autograd: these operators have none. Their shape functions
serve the compiler's fake tensors; a real meta tensor (one made without the model's
device) runs the collective, which refuses it in one sentence as it does eagerly.

    all_reduce(x)            Σ_r x_r
    all_gather_dim0(x)       cat_r x_r along dim 0          [n, ...] -> [g·n, ...]
    reduce_scatter_dim0(x)   rank r's chunk of Σ_r' x_r'    [g·n, ...] -> [n, ...]
    all_to_all(x)            out[j] = rank j's x[r]         [g, ...] -> [g, ...]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from parallel import comm

__all__ = ["all_gather_dim0", "all_reduce", "all_to_all", "reduce_scatter_dim0"]


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def _like(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _gathered(x: torch.Tensor, group: str, again: bool = False) -> torch.Tensor:
    return x.new_empty((dist.get_world_size(_group(group)) * x.size(0), *x.shape[1:]))


def _scattered(x: torch.Tensor, group: str) -> torch.Tensor:
    return x.new_empty((x.size(0) // dist.get_world_size(_group(group)), *x.shape[1:]))


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group=_group(group))
    return out


def _all_gather_dim0(x: torch.Tensor, group: str, again: bool) -> torch.Tensor:
    out = _gathered(x, group)
    comm.all_gather_into_tensor(out, x.contiguous(), group=_group(group))
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group: str) -> torch.Tensor:
    out = _scattered(x, group)
    comm.reduce_scatter_tensor(out, x.contiguous(), group=_group(group))
    return out


def _all_to_all(x: torch.Tensor, group: str) -> torch.Tensor:
    out = _like(x, group)
    comm.all_to_all_single(out, x.contiguous(), group=_group(group))
    return out


@torch.library.custom_op("zero3d::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Σ_r x_r over the group named `group`, in a new tensor."""
    return _all_reduce(x, group)


@torch.library.custom_op("zero3d::all_gather_dim0", mutates_args=())
def all_gather_dim0(x: torch.Tensor, group: str, again: bool) -> torch.Tensor:
    """cat_r x_r along dim 0. `again`: a backward's gather of what its forward gathered, a
    call of its own: the compiler's common-subexpression elimination would otherwise merge
    the two and keep the gathered tensor for backward, the memory sequence parallelism saves."""
    return _all_gather_dim0(x, group, again)


@torch.library.custom_op("zero3d::reduce_scatter_dim0", mutates_args=())
def reduce_scatter_dim0(x: torch.Tensor, group: str) -> torch.Tensor:
    """This rank's 1/g chunk along dim 0 of Σ_r x_r."""
    return _reduce_scatter_dim0(x, group)


@torch.library.custom_op("zero3d::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, group: str) -> torch.Tensor:
    """out[j] = x[r] of rank j, for x [g, ...] on each rank r of the group."""
    return _all_to_all(x, group)


def _shape_function(run: Callable[..., torch.Tensor], empty: Callable[..., torch.Tensor]) -> Callable:
    """An operator's fake implementation: its output's shape (`empty`), or on a real meta
    tensor the collective itself (`run`), which refuses it."""

    def fake(x: torch.Tensor, *args: object) -> torch.Tensor:
        return run(x, *args) if x.device.type == "meta" else empty(x, *args)

    return fake


for _op, _run, _empty in (
    (all_reduce, _all_reduce, _like),
    (all_gather_dim0, _all_gather_dim0, _gathered),
    (reduce_scatter_dim0, _reduce_scatter_dim0, _scattered),
    (all_to_all, _all_to_all, _like),
):
    _op.register_fake(_shape_function(_run, _empty))
