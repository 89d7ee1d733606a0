"""How much slower this machine runs right now than the idle 2-core machine on which the
suite's time limits were set, so that a test that bounds how long something takes allows
that much more on a busy machine (`python -m tests.under_load`) and stays as strict on an
idle one.

    slowdown() = max(1, median seconds of a fixed piece of Python work now / REFERENCE_S)

measured once per test process (under contention each process gets its share of the cores,
and a test's own ranks share them likewise, so the ratio carries over to them).
"""

from __future__ import annotations

import functools
import statistics
import time

# Seconds of `_work()` on the idle 2-core machine (the median of 5, Python 3.11).
REFERENCE_S = 0.04
WORK = 1_000_000


def _work() -> float:
    start = time.perf_counter()
    total = 0
    for i in range(WORK):
        total += i & 7
    return time.perf_counter() - start


@functools.cache
def slowdown() -> float:
    """≥ 1: how many times longer the fixed work takes now than on the idle reference machine."""
    return max(1.0, statistics.median(_work() for _ in range(5)) / REFERENCE_S)


def allow(seconds: float) -> float:
    """A time limit of `seconds` on the idle reference machine, here and now."""
    return seconds * slowdown()
