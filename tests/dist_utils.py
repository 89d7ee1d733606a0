"""`run_distributed`: a test function on N gloo processes (parallel.launch.run_local), with
failures and time-outs turned into test failures."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from parallel.launch import DEFAULT_PRELOAD, RankFailure, run_local

# pytest too: each rank re-imports the parent's __main__, which under pytest is pytest.
PRELOAD = (*DEFAULT_PRELOAD, "pytest")


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    **kwargs: Any) -> list[Any]:
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
