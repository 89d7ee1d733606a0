"""`run_distributed`: a test function on N gloo processes (parallel.launch.run_local), with
failures and time-outs turned into test failures; `run_nccl`: one on a 1-rank NCCL group;
`forbid_collectives`: make torch.distributed's collectives raise in this process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from parallel.launch import DEFAULT_PRELOAD, RankFailure, run_local

# pytest too: each rank re-imports the parent's __main__, which under pytest is pytest.
PRELOAD = (*DEFAULT_PRELOAD, "pytest")


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks (1 thread, seed 0 each);
    their results in rank order. A rank that raises or dies, or a run past ``timeout``
    seconds, fails the test with that rank's traceback (AssertionError)."""
    try:
        return run_local(fn, world_size, *args, timeout=timeout, preload=PRELOAD, **kwargs)
    except RankFailure as e:
        message = str(e)
        if message.startswith("timed out"):
            message = f"distributed test {message}"
        raise AssertionError(message) from None


COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather",
    "all_gather_object",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
    "broadcast",
    "barrier",
)


def forbid_collectives() -> None:
    """Replace each of torch.distributed's `COLLECTIVES` in this process by one that raises
    (for a rank whose work must need none)."""

    def forbidden(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"torch.distributed.{name} was called")

        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, forbidden(name))


def run_nccl(fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in one fresh process whose default group is a 1-rank NCCL group
    on cuda:0 (the gloo group `run_distributed` starts it with is replaced); its result."""
    return run_distributed(_on_nccl, 1, fn, args, kwargs, timeout=timeout)[0]


def _on_nccl(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    dist.destroy_process_group()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return fn(*args, **kwargs)


def dp_by_mp_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """On 4 ranks, 2 data-parallel × 2 model-parallel: (this rank's data-parallel group
    {0, 1} or {2, 3}, its model-parallel group {0, 2} or {1, 3}). Every rank must call it."""
    rank = dist.get_rank()
    dp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    mp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    return dp, mp
