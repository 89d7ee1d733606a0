"""Collectives with per-group call and byte accounting; the marks of parameters.

Every collective in zero3d goes through this module, so that ``tracking()`` can
count, per process-group name and per op, the calls, the ``payload_bytes``
(the tensor bytes handed to the call) and the ``bytes`` this rank puts on the wire
under the ring algorithm. With N = group size and S = tensor bytes:

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
bytes has the payload and wire bytes of one all-reduce of Ψ.

A group of size 1 counts the call, with 0 bytes, but calls no torch.distributed: the
result is a local copy (all-gather, reduce-scatter, all-to-all, all_gather_object) or
nothing to do (all-reduce, broadcast, barrier), and ``async_op=True`` returns an already
completed ``dist.Work``. On gloo with CPU tensors, gloo's all-gather and reduce-scatter
run on a freshly allocated buffer of the full size (page faults included) and copy the
result out of it; there all-gather runs instead as N broadcasts into the pieces of the
output, and a reduce-scatter whose caller passes ``reuse_input=True`` as an all-reduce in
place. Each is still one call here, with the bytes above.

The wrappers take torch's arguments (``reduce_scatter_tensor`` also ``reuse_input``) and
return what torch returns: None, or for ``async_op=True`` a ``dist.Work`` whose ``wait()``
comes before the output is read. When no ``tracking()`` is active, the cost over torch is one ``is not None`` test
plus the flight recorder: every call is also noted, before it is issued, in a short
always-on ring of this rank's last collectives (``recent()``), each with its sequence
number on its channel (a group's ranks, or a p2p sender->receiver pair), so that a
timed-out collective can be matched against what every other rank issued
(``parallel.desync``).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pickle
import re
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None

__all__ = [
    "CommLog",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "group_name",
    "irecv",
    "isend",
    "recent",
    "recv",
    "reduce_scatter_tensor",
    "send",
    "set_group_name",
    "tracking",
    "untracked",
]


# ---------------------------------------------------------------------------
# Group names
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------


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
        self.wait_s = 0.0  # seconds this rank's thread was blocked in collectives (see `_timed`)

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


def _record(group: Group, op: str, payload: int, wire: int) -> None:
    name = group_name(group)
    log = _log
    while log is not None:
        log._add(name, op, payload, wire)
        log = log._outer


def _blocked(seconds: float) -> None:
    log = _log
    while log is not None:
        log.wait_s += seconds
        log = log._outer


def _timed(collective: Callable[..., Any]) -> Callable[..., Any]:
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
            return _Timed(out)
        if isinstance(out, list) and out and isinstance(out[0], dist.Work):
            return [_Timed(w) for w in out]
        _blocked(time.perf_counter() - start)
        return out

    return timed


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _ring(group: Group, s: int) -> int:
    """S·(N−1)//N: what each rank sends in a ring reduce-scatter or all-gather of S bytes
    (all-reduce: one of each, S → 2S). 0 for N = 1, and for a rank outside the group,
    where torch does nothing."""
    n = dist.get_world_size(group)
    return s * (n - 1) // n if n > 1 else 0


# ---------------------------------------------------------------------------
# Flight recorder
# ---------------------------------------------------------------------------

FLIGHT_LENGTH = 8  # collectives kept per rank
_flight: deque[dict[str, Any]] = deque(maxlen=FLIGHT_LENGTH)
_issued: dict[str, int] = {}  # channel -> collectives issued on it so far
_channels: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()
_doing: str | None = None  # what the collectives issued now are part of (``doing()``)
_sides: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()  # made by side_group()


def _channel(group: Group) -> str:
    """The group's global ranks, "0,2,4" (a `side_group`'s: "0,2,4/side"): the same string
    on every member."""
    pg = dist.group.WORLD if group is None else group
    if pg not in _channels:
        side = "/side" if pg in _sides else ""
        _channels[pg] = ",".join(map(str, dist.get_process_group_ranks(pg))) + side
    return _channels[pg]


def side_group(group: Group) -> dist.ProcessGroup:
    """A new gloo group of ``group``'s ranks for small CPU bookkeeping collectives, which then
    can never be matched with one of ``group``'s own (a rank that skipped a collective there
    waits here instead of exchanging the wrong data); named "<group>-side", with its own
    channel in the flight recorder. Every rank of ``group`` calls it."""
    pg = dist.group.WORLD if group is None else group
    try:  # the group's own timeout, not torch's default for a new group (30 minutes on gloo)
        timeout = pg._get_backend(pg._device_types[0]).options._timeout
    except (AttributeError, IndexError, RuntimeError):
        timeout = None
    side = dist.new_group(
        dist.get_process_group_ranks(pg), backend="gloo", timeout=timeout, use_local_synchronization=True
    )
    _sides.add(side)
    set_group_name(side, f"{group_name(group)}-side")
    return side


_RUNS_ON = {"nccl": ("cuda",), "gloo": ("cpu", "cuda")}  # the devices each backend's collectives take


def _placed(group: Group, op: str, *tensors: torch.Tensor) -> None:
    """Refuse, in one sentence, a collective whose tensors are not on one device its backend
    runs on: a tensor made without the model's device lands on the default device (the CPU,
    or meta in tests/test_placement.py), which NCCL cannot take."""
    devices = {t.device for t in tensors}
    backend = str(dist.get_backend(group))
    allowed = _RUNS_ON.get(backend)
    if len(devices) > 1 or (allowed is not None and next(iter(devices)).type not in allowed):
        where = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"{op} on group {group_name(group)} ({backend}) got tensors on {where}: every tensor of a "
            f"collective must be on one of {', '.join(allowed or ('one device',))}; create it on the model's "
            "device (device=param.device)"
        )


def _note(group: Group, op: str, nbytes: int, channel: str | None = None) -> None:
    """Append one issued collective to the flight recorder (``channel``: a p2p pair's)."""
    channel = channel or _channel(group)
    seq = _issued[channel] = _issued.get(channel, 0) + 1
    _flight.append(
        {
            "op": op,
            "group": group_name(group),
            "channel": channel,
            "seq": seq,
            "bytes": nbytes,
            "time": time.time(),
            "what": _doing,
        }
    )


@contextmanager
def doing(what: str) -> Iterator[None]:
    """Note the collectives issued inside as part of ``what`` (e.g. "a stage-3 parameter
    gather inside forward"): the watchdog and the desync report quote it."""
    global _doing
    saved, _doing = _doing, what
    try:
        yield
    finally:
        _doing = saved


def _p2p(src: int, dst: int) -> str:
    return f"{src}->{dst}"


def recent() -> dict[str, Any]:
    """This rank's last ``FLIGHT_LENGTH`` collectives, oldest first (each: op, group name,
    channel, seq = its number on the channel counting from 1, bytes, unix time, what it is
    part of or None), and the
    count issued per channel: what ``parallel.desync`` publishes and compares."""
    return {"last": list(_flight), "issued": dict(_issued)}


def reset_flight() -> None:
    """Forget the recorder's history (a new set of process groups starts counting anew)."""
    _flight.clear()
    _issued.clear()
    _channels.clear()


def collect(store: dist.Store, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The last published ``recent()`` record of each of ``ranks`` (those that never
    published are left out), read from ``store`` under the keys "rank_<r>"."""
    out = {}
    for r in ranks:
        key = f"rank_{r}"
        if store.check([key]):
            out[r] = json.loads(store.get(key))
    return out


def members(channel: str) -> list[int]:
    """The global ranks of a channel ("0,2,4", "0,2,4/side" or a p2p "1->2")."""
    return [int(r) for r in re.split(r",|->", channel.removesuffix("/side"))]


def missing_ranks(mine: dict[str, Any], records: dict[int, dict[str, Any]]) -> tuple[dict[str, Any] | None, list[int]]:
    """(the oldest of my recent collectives that some member of its channel has not issued,
    those members) or (None, []) when every member issued all of them. A member that never
    published counts as not arrived."""
    for entry in mine["last"]:
        behind = [
            r
            for r in members(entry["channel"])
            if records.get(r, {}).get("issued", {}).get(entry["channel"], 0) < entry["seq"]
        ]
        if behind:
            return entry, behind
    return None, []


def describe(entry: dict[str, Any]) -> str:
    """ "a stage-3 parameter gather inside forward (all_gather_into_tensor #12 on dp)"."""
    where = f"{entry['op']} #{entry['seq']} on {entry['group']}"
    return f"{entry['what']} ({where})" if entry.get("what") else where


# ---------------------------------------------------------------------------
# Watchdog
# ---------------------------------------------------------------------------

WATCH_INTERVAL_S = 1.0
_WATCH_PREFIX = "zero3d/watchdog/"
_watchdog: _Watchdog | None = None


def watch(timeout_s: float, advice: str) -> None:
    """Watch this process's collectives: when its last one has waited ``timeout_s`` for a rank
    that did not issue it (or issued a different one in its place), every watched rank prints
    one sentence naming the ranks and what each is in, then ``advice``, and exits with
    status 1 (no hang, whatever loop runs the collectives). A daemon thread publishes the
    flight record to the rendezvous store whenever it changed (about once a second) and reads
    the other ranks' only once its own has not changed for ``timeout_s``. A collective: every
    rank of the default group calls it (later calls change the timeout and advice; a new
    default group gets a new thread)."""
    global _watchdog
    base = dist.distributed_c10d._get_default_store()
    if _watchdog is None or _watchdog.base is not base:
        if _watchdog is not None:
            _watchdog.retired.set()
        _watchdog = _Watchdog(base)
    _watchdog.timeout_s, _watchdog.advice = timeout_s, advice


def unwatch() -> None:
    """Stop the watchdog thread and wait for it (a few seconds at most). It runs at exit and
    before the process group is destroyed: a daemon thread that Python's finalization finds
    inside a store call aborts the process ("terminate called without an active exception")."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.retired.set()
        _watchdog.thread.join(timeout=5 * WATCH_INTERVAL_S)
        _watchdog = None


atexit.register(unwatch)


class _Watchdog:
    """The thread behind ``watch()``, on the default group's rendezvous store ``base``."""

    def __init__(self, base: dist.Store) -> None:
        self.base, self.store, self.rank = base, dist.PrefixStore(_WATCH_PREFIX, base), dist.get_rank()
        self.timeout_s, self.advice = 0.0, ""
        self.retired = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="zero3d-watchdog")
        self.thread.start()

    def _run(self) -> None:
        published, changed = None, time.monotonic()
        try:
            while not self.retired.wait(WATCH_INTERVAL_S):
                if self.store.check(["stopped"]):
                    _stop(f"rank {self.rank}: stopped by the collective watchdog: {self.store.get('stopped').decode()}")
                record = recent()
                if record != published:
                    self.store.set(f"rank_{self.rank}", json.dumps(record))
                    published, changed = record, time.monotonic()
                elif record["last"] and time.monotonic() - changed >= self.timeout_s:
                    self._check(record)
        except (RuntimeError, OSError, ValueError):
            return  # the store is gone: the job is ending

    def _check(self, mine: dict[str, Any]) -> None:
        """Stop every rank if a member of my last collective's channel did not issue it, or
        issued another collective in its place."""
        last = mine["last"][-1]
        others = collect(self.store, [r for r in members(last["channel"]) if r != self.rank])
        stuck = []
        for r in members(last["channel"]):
            if r == self.rank:
                continue
            record = others.get(r)
            issued = record["issued"].get(last["channel"], 0) if record else 0
            theirs = (
                [e for e in record["last"] if (e["channel"], e["seq"]) == (last["channel"], last["seq"])]
                if record
                else []
            )
            if issued < last["seq"]:
                stuck.append(
                    f"rank {r} did not arrive: "
                    + (
                        f"its last collective is {describe(record['last'][-1])}"
                        if record and record["last"]
                        else "it issued no collective"
                    )
                )
            elif theirs and (theirs[0]["op"], theirs[0]["bytes"], theirs[0].get("what")) != (
                last["op"],
                last["bytes"],
                last.get("what"),
            ):
                stuck.append(f"rank {r} is in {describe(theirs[0])} in its place")
        if stuck:
            sentence = (
                f"collectives out of step for {self.timeout_s:g} s: rank {self.rank} waits in {describe(last)}; "
                + "; ".join(stuck)
                + f". {self.advice}"
            )
            if self.store.add("fired", 1) == 1:
                self.store.set("stopped", sentence)
            _stop(f"rank {self.rank}: {self.store.get('stopped').decode()}", linger_s=3 * WATCH_INTERVAL_S)


def _stop(line: str, linger_s: float = 0.0) -> None:
    """Print ``line`` to stderr and end the process with status 1 at once (a normal exit
    could wait on the stalled collective), after ``linger_s`` for the other ranks to read
    the sentence from the store."""
    print(line, file=sys.stderr, flush=True)
    time.sleep(linger_s)
    os._exit(1)


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------


def _renamed(name: str, old_name: str) -> Any:
    """``torch.distributed.<name>``, or ``<old_name>`` where torch predates the name: torch
    2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
    reduce_scatter_single (same signature) and deprecated the old names, which are all that
    torch 2.11 has."""
    return getattr(dist, name, None) or getattr(dist, old_name)


class _Completed(dist.Work):
    """A ``dist.Work`` that is already done: ``async_op=True`` of a collective run locally."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


class _AllOf(dist.Work):
    """Several ``dist.Work`` as one: done when all are; ``wait`` waits for each in turn, then
    runs ``then`` (once), which finishes the result."""

    def __init__(
        self, works: list[dist.Work], result: list[torch.Tensor], then: Callable[[], None] | None = None
    ) -> None:
        super().__init__()
        self._works, self._result, self._then = works, result, then

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait() if timeout is None else w.wait(timeout)
        then, self._then = self._then, None
        if then is not None:
            then()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(lambda _: self._result)


class _Timed(dist.Work):
    """A ``dist.Work`` whose ``wait()`` adds the seconds it blocks to the recording logs."""

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: Any = None) -> bool:
        start = time.perf_counter()
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        _blocked(time.perf_counter() - start)
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


def _alone(group: Group) -> bool:
    """The group is this rank alone: its collectives are local copies or nothing, on the
    caller's stream (tests/test_cuda.py turns this off to send them through NCCL)."""
    return dist.get_world_size(group) == 1


def _local(async_op: bool, *outputs: torch.Tensor) -> dist.Work | None:
    """What torch returns for a collective that is already done."""
    return _Completed(list(outputs)) if async_op else None


def _copy(output: torch.Tensor, input: torch.Tensor) -> None:
    """output := input (as many elements), nothing when both are the same memory."""
    if output.data_ptr() != input.data_ptr():
        output.copy_(input.reshape(output.shape))


def _gloo_cpu(group: Group, tensor: torch.Tensor) -> bool:
    """The collective on ``tensor`` runs on gloo, in host memory."""
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def _unless_async(work: dist.Work, async_op: bool) -> dist.Work | None:
    """What torch returns: `work` for async_op, else None once it is done."""
    if async_op:
        return work
    work.wait()
    return None


def _all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group: Group, n: int) -> dist.Work:
    """The exact all-gather as N broadcasts, group rank r's ``input`` into piece r of
    ``output`` (contiguous), with no buffer of its own; this rank's piece is copied first."""
    pieces = output.view(n, -1)
    _copy(pieces[dist.get_rank(group)], input)
    works = [dist.broadcast(pieces[r], group=group, async_op=True, group_src=r) for r in range(n)]
    return _AllOf(works, [output])


def _reduce_scatter_in_place(
    output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp.RedOpType, group: Group, n: int
) -> dist.Work:
    """The reduce-scatter as an all-reduce in place in ``input`` (contiguous); ``wait()`` then
    copies this rank's shard into ``output`` (nothing when ``output`` is that shard)."""
    work = dist.all_reduce(input, op=op, group=group, async_op=True)
    shard = input.view(n, -1)[dist.get_rank(group)]
    return _AllOf([work], [output], then=lambda: _copy(output, shard))


@_timed
def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> dist.Work | None:
    """In-place all-reduce. bytes = 2·S·(N−1)/N, payload = S."""
    _placed(group, "all_reduce", tensor)
    _note(group, "all_reduce", _nbytes(tensor))
    work = _local(async_op, tensor) if _alone(group) else dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    if _log is not None:
        s = _nbytes(tensor)
        _record(group, "all_reduce", s, _ring(group, 2 * s))
    return work


@_timed
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    reuse_input: bool = False,
) -> dist.Work | None:
    """Reduce ``input`` (N·shard) over the group; rank i keeps shard i in ``output``.
    ``reuse_input``: the caller does not read ``input`` again, so on gloo with CPU tensors
    the reduction runs as an all-reduce in place in ``input`` (gloo's own reduce-scatter
    all-reduces a fresh copy of ``input``, then copies shard i out of it) and ``wait()``
    copies shard i into ``output``. bytes = S_in·(N−1)/N, payload = S_in."""
    _placed(group, "reduce_scatter_tensor", output, input)
    _note(group, "reduce_scatter_tensor", _nbytes(input))
    n = dist.get_world_size(group)
    if _alone(group):
        _copy(output, input)
        work = _local(async_op, output)
    elif reuse_input and _gloo_cpu(group, input):
        work = _unless_async(_reduce_scatter_in_place(output, input, op, group, n), async_op)
    else:
        work = _renamed("reduce_scatter_single", "reduce_scatter_tensor")(
            output, input, op=op, group=group, async_op=async_op
        )
    if _log is not None:
        s = _nbytes(input)
        _record(group, "reduce_scatter_tensor", s, _ring(group, s))
    return work


@_timed
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> dist.Work | None:
    """Split ``input`` along dim 0 (into N equal parts, or ``input_split_sizes``) and send
    part j to rank j; ``output`` holds the part from each rank, in rank order (sized by
    ``output_split_sizes``). bytes = what leaves this rank (all parts but its own: S_in·(N−1)/N
    for equal parts), payload = S_in."""
    _placed(group, "all_to_all_single", output, input)
    _note(group, "all_to_all_single", _nbytes(input))
    if _alone(group):
        _copy(output, input)
        work = _local(async_op, output)
    else:
        work = dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
    if _log is not None:
        s = _nbytes(input)
        if input_split_sizes is None:
            sent = _ring(group, s)
        else:
            row = s // max(input.shape[0], 1)
            sent = row * (sum(input_split_sizes) - input_split_sizes[dist.get_rank(group)])
        _record(group, "all_to_all_single", s, sent)
    return work


@_timed
def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Concatenate every rank's ``input`` into ``output`` (N·shard); on gloo with CPU tensors
    by N broadcasts (module docstring). bytes = S_out·(N−1)/N, payload = S_out."""
    _placed(group, "all_gather_into_tensor", output, input)
    _note(group, "all_gather_into_tensor", _nbytes(output))
    n = dist.get_world_size(group)
    if _alone(group):
        _copy(output, input)
        work = _local(async_op, output)
    elif _gloo_cpu(group, output):
        work = _unless_async(_all_gather_by_broadcasts(output, input, group, n), async_op)
    else:
        work = _renamed("all_gather_single", "all_gather_into_tensor")(output, input, group=group, async_op=async_op)
    if _log is not None:
        s = _nbytes(output)
        _record(group, "all_gather_into_tensor", s, _ring(group, s))
    return work


@_timed
def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False) -> dist.Work | None:
    """Copy ``tensor`` from global rank ``src`` to the group.
    bytes = S on src (N > 1), 0 elsewhere; payload = S on every rank."""
    _placed(group, "broadcast", tensor)
    _note(group, "broadcast", _nbytes(tensor))
    work = (
        _local(async_op, tensor) if _alone(group) else dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    )
    if _log is not None:
        s = _nbytes(tensor)
        sends = dist.get_rank() == src and dist.get_world_size(group) > 1
        _record(group, "broadcast", s, s if sends else 0)
    return work


@_timed
def all_gather_object(obj: Any, group: Group = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order.
    bytes = P·(N−1), payload = P, with P = len(pickle.dumps(obj))."""
    _note(group, "all_gather_object", 0)
    n = dist.get_world_size(group)
    out: list[Any] = [None] * n
    if _alone(group):
        out[0] = pickle.loads(pickle.dumps(obj))  # a copy, as torch's
    else:
        dist.all_gather_object(out, obj, group=group)
    if _log is not None:
        p = len(pickle.dumps(obj))
        _record(group, "all_gather_object", p, p * (n - 1))
    return out


@_timed
def barrier(group: Group = None) -> None:
    """Block until every rank of the group arrives. bytes = payload = 0."""
    _note(group, "barrier", 0)
    if not _alone(group):
        dist.barrier(group=group)
    if _log is not None:
        _record(group, "barrier", 0, 0)


@_timed
def send(tensor: torch.Tensor, dst: int, group: Group = None) -> None:
    """Blocking send to global rank ``dst``. bytes = payload = S."""
    _placed(group, "send", tensor)
    _note(group, "send", _nbytes(tensor), _p2p(dist.get_rank(), dst))
    dist.send(tensor, dst=dst, group=group)
    if _log is not None:
        s = _nbytes(tensor)
        _record(group, "send", s, s)


@_timed
def recv(tensor: torch.Tensor, src: int, group: Group = None) -> int:
    """Blocking receive from global rank ``src``; returns torch's sender rank.
    bytes = 0, payload = S."""
    _placed(group, "recv", tensor)
    _note(group, "recv", _nbytes(tensor), _p2p(src, dist.get_rank()))
    sender = dist.recv(tensor, src=src, group=group)
    if _log is not None:
        _record(group, "recv", _nbytes(tensor), 0)
    return sender


@_timed
def isend(tensor: torch.Tensor, dst: int, group: Group = None) -> dist.Work | None:
    """Non-blocking send to global rank ``dst``. bytes = payload = S."""
    _placed(group, "isend", tensor)
    _note(group, "isend", _nbytes(tensor), _p2p(dist.get_rank(), dst))
    work = dist.isend(tensor, dst=dst, group=group)
    if _log is not None:
        s = _nbytes(tensor)
        _record(group, "isend", s, s)
    return work


@_timed
def irecv(tensor: torch.Tensor, src: int, group: Group = None) -> dist.Work | None:
    """Non-blocking receive from global rank ``src``. bytes = 0, payload = S."""
    _placed(group, "irecv", tensor)
    _note(group, "irecv", _nbytes(tensor), _p2p(src, dist.get_rank()))
    work = dist.irecv(tensor, src=src, group=group)
    if _log is not None:
        _record(group, "irecv", _nbytes(tensor), 0)
    return work


@_timed
def batch_isend_irecv(p2p_ops: list[dist.P2POp]) -> list[dist.Work]:
    """Issue ``dist.P2POp(dist.isend | dist.irecv, ...)`` ops together; each op is
    counted as one "isend" (bytes = S) or "irecv" (bytes = 0) under its group."""
    me = dist.get_rank()
    for p2p in p2p_ops:
        send = p2p.op is dist.isend
        pair = _p2p(me, p2p.peer) if send else _p2p(p2p.peer, me)
        _placed(p2p.group, "isend" if send else "irecv", p2p.tensor)
        _note(p2p.group, "isend" if send else "irecv", _nbytes(p2p.tensor), pair)
    works = dist.batch_isend_irecv(p2p_ops)
    if _log is not None:
        for p2p in p2p_ops:
            s = _nbytes(p2p.tensor)
            if p2p.op is dist.isend:
                _record(p2p.group, "isend", s, s)
            else:
                _record(p2p.group, "irecv", s, 0)
    return works
