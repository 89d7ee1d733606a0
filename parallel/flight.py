"""The flight recorder: every collective issued through `parallel.comm` is noted, before it
is issued, in a short always-on ring of this rank's last collectives (``recent()``), each with
its sequence number on its channel (a group's global ranks, or a p2p sender->receiver pair),
so that a collective that never returns can be matched against what every other rank issued
(`parallel.desync`, which publishes the records and judges them).
"""

from __future__ import annotations

import json
import re
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from parallel import accounting

Group = dist.ProcessGroup | None

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
    accounting.set_group_name(side, f"{accounting.group_name(group)}-side")
    return side


def note(group: Group, op: str, nbytes: int, channel: str | None = None) -> None:
    """Append one issued collective to the flight recorder (``channel``: a p2p pair's)."""
    channel = channel or _channel(group)
    seq = _issued[channel] = _issued.get(channel, 0) + 1
    _flight.append(
        {
            "op": op,
            "group": accounting.group_name(group),
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


def p2p_channel(src: int, dst: int) -> str:
    """The channel of point-to-point messages from global rank `src` to `dst`."""
    return f"{src}->{dst}"


def recent() -> dict[str, Any]:
    """This rank's last ``FLIGHT_LENGTH`` collectives, oldest first (each: op, group name,
    channel, seq = its number on the channel counting from 1, bytes, unix time, what it is
    part of or None), and the
    count issued per channel: what `parallel.desync` publishes and compares."""
    return {"last": list(_flight), "issued": dict(_issued)}


def reset() -> None:
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
