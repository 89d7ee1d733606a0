"""The multi-process test harness itself."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.timing import allow


def _describe(offset: int, *, scale: int) -> dict:
    t = torch.full((1,), float(dist.get_rank()))
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env_rank": int(os.environ["RANK"]),
        "value": (dist.get_rank() + offset) * scale,
        "sum": t,
        "threads": torch.get_num_threads(),
        "first_rand": torch.rand(3),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_per_rank_values_in_rank_order(world_size: int) -> None:
    out = run_distributed(_describe, world_size, 10, scale=2)
    torch.manual_seed(0)
    expected_rand = torch.rand(3)
    assert [o["rank"] for o in out] == list(range(world_size))
    for r, o in enumerate(out):
        assert (o["world"], o["env_rank"], o["threads"]) == (world_size, r, 1)
        assert o["value"] == (r + 10) * 2
        assert o["sum"].item() == sum(range(world_size))
        assert torch.equal(o["first_rand"], expected_rand)


def _rank1_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 would wait here forever: it must be killed, not awaited


def test_exception_names_rank_and_carries_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_rank1_raises, 2, timeout=60)
    message = str(info.value)
    assert "rank 1 of 2 failed" in message
    assert "Traceback (most recent call last)" in message
    assert "in _rank1_raises" in message
    assert "ValueError: boom from rank one" in message
    assert time.monotonic() - start < allow(30)


def _rank1_hangs() -> int:
    if dist.get_rank() == 1:
        time.sleep(3600)
    return dist.get_rank()


@pytest.mark.slow
def test_hanging_rank_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"distributed test timed out after 3s on ranks \[1\]"):
        run_distributed(_rank1_hangs, 2, timeout=3)
    assert time.monotonic() - start < allow(15)


def _rank0_dies() -> None:
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def test_rank_that_dies_without_result() -> None:
    with pytest.raises(AssertionError, match="rank 0 of 2 failed:\nprocess exited with code 3"):
        run_distributed(_rank0_dies, 2, timeout=60)
