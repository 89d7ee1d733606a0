"""Accounting of collectives: group names, and per group and op the calls, the
``payload_bytes`` (the tensor bytes handed to the call) and the ``bytes`` this rank puts on
the wire under the ring algorithm, counted by `parallel.comm`'s wrappers while a
``tracking()`` block is active. With N = group size and S = tensor bytes:

    all_reduce               2·S·(N−1)/N     (reduce-scatter, then all-gather)
    reduce_scatter_tensor    S_in·(N−1)/N    (S_in: the full, unsharded input)
    all_to_all_single        S_in·(N−1)/N    (equal splits; uneven ones: the bytes of the parts sent to other ranks)
    all_gather_into_tensor   S_out·(N−1)/N   (S_out: the full, gathered output)
    broadcast                S on src, 0 elsewhere
    send / isend             S
    recv / irecv             0
    all_gather_object        P·(N−1)         (P: the pickled object; torch's size
                                              exchange and padding are not counted)
    barrier                  0

Arithmetic is integer: ``S*(N-1)//N``. zero3d pads every sharded buffer to a
multiple of N elements, so the division is exact. ``payload_bytes`` of reduce-scatter and
all-gather is the full tensor, so that ZeRO's reduce-scatter + all-gather of Ψ
bytes has the payload and wire bytes of one all-reduce of Ψ. A group of size 1 counts the
call, with 0 bytes.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


_names: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()


def set_group_name(group: Group, name: str) -> None:
    """Label ``group`` (None: the world group) as ``name`` in the stats.

    The label lives as long as the group object. DeviceMesh returns the world group
    itself for a dimension that spans all ranks: labelling it also labels
    ``group=None`` calls, and at world size 1 every dimension shares one label.
    """
    _names[dist.group.WORLD if group is None else group] = name


def group_name(group: Group) -> str:
    """The label set by ``set_group_name``; else "world" for None / WORLD; else the
    group's ``group_desc`` (DeviceMesh sets "mesh_<dim>"); else "ranks[0,1,..]"."""
    pg = dist.group.WORLD if group is None else group
    if pg in _names:
        return _names[pg]
    if pg is dist.group.WORLD:
        return "world"
    if pg.group_desc not in ("", "undefined"):
        return pg.group_desc
    return f"ranks[{','.join(map(str, dist.get_process_group_ranks(pg)))}]"


class CommLog:
    """Per group name -> per op name -> {"calls", "bytes", "payload_bytes"}.

    Filled by the wrappers of this module while the ``tracking()`` block that
    yielded it is active (from any thread); ``on_call(group, op, payload_bytes, bytes)`` is
    called for each call as it is counted, on the thread that issued it.
    """

    def __init__(self, on_call: Callable[[str, str, int, int], None] | None = None) -> None:
        self._stats: dict[str, dict[str, dict[str, int]]] = {}
        self._outer: CommLog | None = None  # the enclosing tracking() log, if nested
        self._on_call = on_call
        self.wait_s = 0.0  # seconds this rank's thread was blocked in collectives (see `timed`)

    def _add(self, group: str, op: str, payload: int, wire: int) -> None:
        if self._on_call is not None:
            self._on_call(group, op, payload, wire)
        ops = self._stats.setdefault(group, {})
        entry = ops.setdefault(op, {"calls": 0, "bytes": 0, "payload_bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += wire
        entry["payload_bytes"] += payload

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """A copy of the stats."""
        return {g: {op: dict(e) for op, e in ops.items()} for g, ops in self._stats.items()}

    def _sum(self, key: str, group_name: str | None, op: str | None) -> int:
        return sum(
            e[key]
            for g, ops in self._stats.items()
            if group_name in (None, g)
            for o, e in ops.items()
            if op in (None, o)
        )

    def total_bytes(self, group_name: str | None = None, op: str | None = None) -> int:
        """Wire bytes sent by this rank, over all groups / ops unless one is named."""
        return self._sum("bytes", group_name, op)

    def calls(self, group_name: str | None = None, op: str | None = None) -> int:
        """Number of calls, over all groups / ops unless one is named."""
        return self._sum("calls", group_name, op)

    def reset(self) -> None:
        """Forget everything recorded so far (recording goes on if active)."""
        self._stats.clear()
        self.wait_s = 0.0

    def __repr__(self) -> str:
        return f"CommLog({self._stats!r})"


_log: CommLog | None = None  # innermost active tracking() log


@contextmanager
def tracking(on_call: Callable[[str, str, int, int], None] | None = None) -> Iterator[CommLog]:
    """Record every collective issued through this module into a fresh ``CommLog`` (each
    call also passed to ``on_call``, see there).

    Blocks nest: a call inside an inner block is recorded by the inner log and by
    every enclosing one. A log stops recording when its block exits.
    """
    global _log
    log = CommLog(on_call)
    log._outer = _log
    _log = log
    try:
        yield log
    finally:
        _log = log._outer


@contextmanager
def untracked() -> Iterator[None]:
    """Collectives inside are left out of every ``tracking()`` log (bookkeeping such as
    metrics gathered over ranks); the flight recorder still notes them."""
    global _log
    saved, _log = _log, None
    try:
        yield
    finally:
        _log = saved


def record(group: Group, op: str, payload: int, wire: int) -> None:
    name = group_name(group)
    log = _log
    while log is not None:
        log._add(name, op, payload, wire)
        log = log._outer


def blocked(seconds: float) -> None:
    log = _log
    while log is not None:
        log.wait_s += seconds
        log = log._outer


def timed(collective: Callable[..., Any]) -> Callable[..., Any]:
    """While a log records: the seconds the calling thread is blocked in `collective` (a
    blocking call: all of it; an async one: in its works' `wait()`) go to `CommLog.wait_s`.
    What a rank waits there is its peers' lateness and the wire time; on CUDA a collective
    only blocks the host where the host waits for the device, so this counts gloo and host
    syncs, not time on the device's streams."""

    @functools.wraps(collective)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if _log is None:
            return collective(*args, **kwargs)
        start = time.perf_counter()
        out = collective(*args, **kwargs)
        if isinstance(out, dist.Work):
            return TimedWork(out)
        if isinstance(out, list) and out and isinstance(out[0], dist.Work):
            return [TimedWork(w) for w in out]
        blocked(time.perf_counter() - start)
        return out

    return timed


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def ring_bytes(group: Group, s: int) -> int:
    """S·(N−1)//N: what each rank sends in a ring reduce-scatter or all-gather of S bytes
    (all-reduce: one of each, S → 2S). 0 for N = 1, and for a rank outside the group,
    where torch does nothing."""
    n = dist.get_world_size(group)
    return s * (n - 1) // n if n > 1 else 0


def recording() -> bool:
    """Whether a ``tracking()`` block is active (the wrappers skip counting otherwise)."""
    return _log is not None


class TimedWork(dist.Work):
    """A ``dist.Work`` whose ``wait()`` adds the seconds it blocks to the recording logs."""

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: Any = None) -> bool:
        start = time.perf_counter()
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        blocked(time.perf_counter() - start)
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def synchronize(self) -> None:
        self._work.synchronize()

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()
