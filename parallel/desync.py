"""The hang detector: ranks out of step, collectives that time out, a store that is gone.

Every rank notes each collective it issues in the flight recorder (`parallel.flight`): op,
group, channel (the group's global ranks, or a p2p "sender->receiver" pair) and its
sequence number on that channel. One daemon thread per process, started by whoever owns the
run (`report_timeouts()`, which the training command enters, or `watch()`, which
ZeroOptimizer calls in any training loop), publishes that record with a heartbeat to the
rendezvous store about once a second, so a rank that stalls (stopped, stuck in a kernel,
looping) leaves behind what it last issued; and, under `watch()`, once this rank's last
collective has waited `timeout_s` for a rank that never issued it (or issued another in its
place), it stops every rank with one sentence (the collective watchdog).

When a collective times out (the process group's timeout: `--comm-timeout`, or
`init_process_group(timeout=...)`), every rank that notices reads all ranks' records and
compares sequence numbers: rank r did not arrive at this rank's collective #s on channel
c if r is in c and has issued fewer than s collectives there. The first rank to notice
prints the report (the collective, the missing ranks and what they issued last, then the
last few collectives of every rank); the others print one line; all exit with status 1.

gloo raises a timed-out collective as a RuntimeError on the waiting rank, which is what
this catches. NCCL's watchdog aborts the process itself (see torch's
TORCH_NCCL_DUMP_ON_TIMEOUT flight recorder); the published records still tell which
rank stalled, through `flight.collect()`.

A store that stops answering for the comm timeout + STORE_GRACE_S ends the rank with one
sentence: judged by a small timer of its own that never calls the store, since a store call
to an unreachable host blocks without end, as may the detector's own publishing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from parallel import flight

CPU_TIMEOUT_S = 180.0  # gloo: a few minutes, then the report
CUDA_TIMEOUT_S = 900.0  # NCCL: longer, its watchdog applies
PUBLISH_INTERVAL_S = 1.0
SILENT_AFTER_S = 5.0
STORE_GRACE_S = 30.0  # past the comm timeout, how long the store may stay silent  # a rank whose heartbeat is older than this is named as silent
STORE_WAIT_S = 10.0  # how long a report waits for the store before giving up on it
REPORT_LENGTH = 4  # collectives per rank in the printed table
_PREFIX = "zero3d/flight"  # + "/<generation>/": one store namespace per report_timeouts() block
_TIMEOUT_TEXT = re.compile(r"timed?[ _-]?out|timeout", re.IGNORECASE)
_PEER_LOST_TEXT = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)
_generation = 0  # report_timeouts() blocks so far: fresh store keys per run
_detector: _Detector | None = None


def default_timeout_s(device_type: str) -> float:
    """The comm timeout when none is given: CPU_TIMEOUT_S on gloo, CUDA_TIMEOUT_S on CUDA."""
    return CUDA_TIMEOUT_S if device_type == "cuda" else CPU_TIMEOUT_S


def set_timeout(seconds: float, groups: list[dist.ProcessGroup | None]) -> None:
    """Give every group in `groups` (None: the default group) a timeout of `seconds`, and
    every group made from now on: torch makes a new group with its own default (30 minutes
    on gloo, 10 on NCCL) whatever the default group has, and a rank that loses a peer while
    the group connects would wait that long."""
    timeout = timedelta(seconds=seconds)
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    dist.distributed_c10d.default_pg_timeout = timeout  # read by new_group when given no timeout
    dist.distributed_c10d.default_pg_nccl_timeout = timeout


def is_timeout(error: BaseException) -> bool:
    """Whether `error` is a collective that timed out (gloo's RuntimeError says so)."""
    return isinstance(error, RuntimeError) and bool(_TIMEOUT_TEXT.search(str(error)))


def is_peer_lost(error: BaseException) -> bool:
    """Whether `error` is a collective whose peer process went away (gloo: connection closed)."""
    return isinstance(error, RuntimeError) and bool(_PEER_LOST_TEXT.search(str(error)))


class _Detector:
    """The one thread (module docstring), on the default group's rendezvous store `base`:
    publishes this rank's flight record and a heartbeat (`beat`, unix time) every
    PUBLISH_INTERVAL_S, noting when the store last answered (`answered[0]`), and, while
    watching (`watch_s`), stops every rank when the collectives are out of step."""

    def __init__(self, base: dist.Store) -> None:
        self.base, self.rank = base, dist.get_rank()
        self.store = self.namespace()
        self.watch_s: float | None = None
        self.advice = ""
        self.reporting = False  # inside report_timeouts(): a store error is the guard's to judge
        self.answered = [time.monotonic()]
        self.retired = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="zero3d-desync")
        self.thread.start()

    def namespace(self) -> dist.Store:
        return dist.PrefixStore(f"{_PREFIX}/{_generation}/", self.base)

    def _run(self) -> None:
        published, changed = None, time.monotonic()
        while not self.retired.wait(PUBLISH_INTERVAL_S):
            store, record = self.store, flight.recent()
            try:
                if self.watch_s is not None and store.check(["stopped"]):
                    _exit(f"rank {self.rank}: stopped by the collective watchdog: {store.get('stopped').decode()}")
                store.set(f"rank_{self.rank}", json.dumps({**record, "beat": time.time()}))
                self.answered[0] = time.monotonic()
            except (RuntimeError, OSError, ValueError):
                if self.reporting:
                    continue  # unanswered: `_guard_store` judges
                return  # the store is gone outside a run's block: the job is ending
            if record != published:
                published, changed = record, time.monotonic()
            elif self.watch_s is not None and record["last"] and time.monotonic() - changed >= self.watch_s:
                self._check(record)

    def _check(self, mine: dict[str, Any]) -> None:
        """Stop every rank if a member of my last collective's channel did not issue it, or
        issued another collective in its place."""
        last = mine["last"][-1]
        others = flight.collect(self.store, [r for r in flight.members(last["channel"]) if r != self.rank])
        stuck = []
        for r in flight.members(last["channel"]):
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
                        f"its last collective is {flight.describe(record['last'][-1])}"
                        if record and record["last"]
                        else "it issued no collective"
                    )
                )
            elif theirs and (theirs[0]["op"], theirs[0]["bytes"], theirs[0].get("what")) != (
                last["op"],
                last["bytes"],
                last.get("what"),
            ):
                stuck.append(f"rank {r} is in {flight.describe(theirs[0])} in its place")
        if stuck:
            sentence = (
                f"collectives out of step for {self.watch_s:g} s: rank {self.rank} waits in {flight.describe(last)}; "
                + "; ".join(stuck)
                + f". {self.advice}"
            )
            if self.store.add("fired", 1) == 1:
                self.store.set("stopped", sentence)
            _exit(f"rank {self.rank}: {self.store.get('stopped').decode()}", linger_s=3 * PUBLISH_INTERVAL_S)


def _running() -> _Detector:
    """The detector on the default group's store, started (again, for a new default group) if need be."""
    global _detector
    base = dist.distributed_c10d._get_default_store()
    if _detector is None or _detector.base is not base or not _detector.thread.is_alive():
        if _detector is not None:
            _detector.retired.set()
        _detector = _Detector(base)
    return _detector


def watch(timeout_s: float, advice: str) -> None:
    """Watch this process's collectives: when its last one has waited ``timeout_s`` for a rank
    that did not issue it (or issued a different one in its place), every watched rank prints
    one sentence naming the ranks and what each is in, then ``advice``, and exits with
    status 1 (no hang, whatever loop runs the collectives). The detector reads the other
    ranks' records only once its own has not changed for ``timeout_s``. A collective: every
    rank of the default group calls it (later calls change the timeout and advice)."""
    detector = _running()
    detector.watch_s, detector.advice = timeout_s, advice


def unwatch() -> None:
    """Stop the detector thread and wait for it (a few seconds at most). It runs at exit and
    before the process group is destroyed: a daemon thread that Python's finalization finds
    inside a store call aborts the process ("terminate called without an active exception")."""
    global _detector
    if _detector is not None:
        _detector.retired.set()
        _detector.thread.join(timeout=5 * PUBLISH_INTERVAL_S)
        _detector = None


atexit.register(unwatch)


@contextlib.contextmanager
def report_timeouts(timeout_s: float | None = None) -> Iterator[None]:
    """Publish this rank's flight record while the block runs; a timed-out collective inside
    it prints the desync report and ends the process with status 1 (no hang, no traceback);
    a collective whose peer exited (it failed, or it reported a timeout) prints one line and
    ends it with status 1 too; a store that stops answering for `timeout_s` + STORE_GRACE_S
    (its host, rank 0's, is unreachable: no collective nor its own timeout can be trusted to
    return) ends it with one sentence. A collective: every rank enters it."""
    global _generation
    _generation += 1
    flight.reset()
    detector = _running()
    detector.store, detector.reporting = detector.namespace(), True
    store, rank, world = detector.store, dist.get_rank(), dist.get_world_size()
    stop = threading.Event()
    patience = (timeout_s or CPU_TIMEOUT_S) + STORE_GRACE_S
    threading.Thread(
        target=_guard_store, args=(rank, stop, detector.answered, patience), daemon=True, name="zero3d-store-guard"
    ).start()
    try:
        yield
    except RuntimeError as error:
        if is_timeout(error):
            stop.set()
            _report_and_exit(store, rank, world, timeout_s)
        if is_peer_lost(error):
            _exit(
                f"rank {rank}: {_waiting_in()}lost its connection to another rank, which exited "
                "(its own message above says why)"
            )
        raise
    finally:
        stop.set()
        detector.reporting = False
        if detector.watch_s is None:
            unwatch()  # never inside a store call when Python finalizes


def _guard_store(rank: int, stop: threading.Event, answered: list[float], patience: float) -> None:
    """End the process when the store has not answered a heartbeat for `patience` seconds
    (`answered[0]`: when it last did, set by the detector): a store call to an unreachable host
    blocks without end, as may the collectives and group creations (gloo's connect) that go
    through it. Reads only that time, never the store."""
    while not stop.wait(PUBLISH_INTERVAL_S):
        silent = time.monotonic() - answered[0]
        if silent > patience:
            where = os.environ.get("MASTER_ADDR", "?")
            doing = _waiting_in().removesuffix(", ") or "not in a collective"
            _exit(
                f"error: rank {rank} lost contact with the rendezvous store at {where} (rank 0's host): no answer for "
                f"{silent:.0f} s ({doing}); {_unreachable()}, so the job cannot go on"
            )
            return


def silent_ranks(records: dict[int, dict[str, Any]], world: int, rank: int, now: float) -> dict[int, float]:
    """{rank: seconds since its last heartbeat} of the other ranks silent for SILENT_AFTER_S
    (records without a heartbeat, written by hand, are not judged)."""
    return {
        r: now - records[r]["beat"]
        for r in range(world)
        if r != rank and r in records and "beat" in records[r] and now - records[r]["beat"] > SILENT_AFTER_S
    }


def stalled_ranks(behind: list[int], records: dict[int, dict[str, Any]]) -> tuple[list[int], dict[int, int]]:
    """Follow the waits from the ranks that did not arrive: a rank that itself waits for
    another in an earlier collective is blocked, not stalled. Returns (the ranks at the ends
    of those waits, in order; blocked rank -> the rank it waits for). Ranks that wait for each
    other in a cycle have no end: then `behind` itself is returned."""
    blocked: dict[int, int] = {}
    stalled: list[int] = []
    pending, seen = list(behind), set()
    while pending:
        r = pending.pop(0)
        if r in seen:
            continue
        seen.add(r)
        _, waits_for = flight.missing_ranks(records[r], records) if r in records else (None, [])
        waits_for = [w for w in waits_for if w != r]
        if waits_for:
            blocked[r] = waits_for[0]
            pending += waits_for
        else:
            stalled.append(r)
    return (sorted(stalled), blocked) if stalled else (behind, {})


def _describe(entry: dict[str, Any], now: float) -> str:
    what = f"{entry['what']}: " if entry.get("what") else ""
    return (
        f"{what}{entry['op']} #{entry['seq']} on {entry['group']} [{entry['channel']}] "
        f"({entry['bytes']} B, {now - entry['time']:.1f} s ago)"
    )


def report(
    rank: int, records: dict[int, dict[str, Any]], world: int, timeout_s: float | None, now: float | None = None
) -> str:
    """The desync report as `rank` sees it: one sentence, then each rank's last collectives."""
    now = time.time() if now is None else now
    mine = records.get(rank, flight.recent())
    waited = f" after {timeout_s:g} s" if timeout_s else ""
    entry, behind = flight.missing_ranks(mine, records)
    blocked: dict[int, int] = {}
    if entry is None:
        head = (
            f"a collective timed out{waited} on rank {rank}, but every rank issued its recent collectives: "
            "the ranks are waiting in different collectives (see the order below)"
        )
    else:
        behind, blocked = stalled_ranks(behind, records)
        last = [
            f"rank {r} last issued {_describe(records[r]['last'][-1], now)}"
            if records.get(r, {}).get("last")
            else f"rank {r} never reported"
            for r in behind
        ]
        last += [
            f"rank {r} waits for rank {w} in {_describe(flight.missing_ranks(records[r], records)[0], now)}"
            for r, w in sorted(blocked.items())
        ]
        head = (
            f"a collective timed out{waited}: rank(s) {', '.join(map(str, behind))} did not arrive at "
            f"{entry['op']} #{entry['seq']} on {entry['group']} [{entry['channel']}] that rank {rank} waits in; "
            + "; ".join(last)
        )
    silent = silent_ranks(records, world, rank, now)
    if silent:
        lost = (
            f"rank(s) {', '.join(map(str, silent))} have been silent for {min(silent.values()):.0f} s or more "
            "(no heartbeat to the store: they died or hung, or their host's network is down)"
        )
        head = f"a collective timed out{waited} on rank {rank}: {lost}" if entry is None else f"{head}; {lost}"
    lines = [
        head + ". Raise --comm-timeout if a rank is only slow, else look at what the ranks above were doing.",
        "last collectives per rank (op #seq on group [channel ranks], oldest first):",
    ]
    for r in range(world):
        if r not in records:
            lines.append(f"  rank {r}: nothing published (stalled before its first collective, or the store is gone)")
            continue
        tag = " (did not arrive)" if r in behind else f" (waits for rank {blocked[r]})" if r in blocked else ""
        tag += f" (silent {silent[r]:.0f} s)" if r in silent else ""
        ops = " | ".join(_describe(e, now) for e in records[r]["last"][-REPORT_LENGTH:]) or "none"
        lines.append(f"  rank {r}{tag}: {ops}")
    return "\n".join(lines)


def _report_and_exit(store: dist.Store, rank: int, world: int, timeout_s: float | None) -> None:
    """Publish my final record, print the report (first rank to notice) or one line, exit 1."""
    result: dict[str, Any] = {}

    def gather() -> None:
        store.set(f"rank_{rank}", json.dumps(flight.recent()))
        result["first"] = store.add("timeouts", 1) == 1
        result["records"] = flight.collect(store, range(world))

    worker = threading.Thread(target=gather, daemon=True)
    worker.start()
    worker.join(STORE_WAIT_S)
    if "records" not in result:
        _exit(
            f"error: a collective timed out on rank {rank} and the rendezvous store did not answer within "
            f"{STORE_WAIT_S:g} s: {_unreachable()}. Rank {rank}'s last collectives: "
            + " | ".join(_describe(e, time.time()) for e in flight.recent()["last"])
        )
    elif result["first"]:
        _exit("error: " + report(rank, result["records"], world, timeout_s))
    else:
        _exit(f"rank {rank}: {_waiting_in()}timed out; another rank printed the desync report")


def _unreachable() -> str:
    """Who this rank lost when neither its collective nor the store answers: the other hosts'
    ranks of the collective it waits in (torchrun's GROUP_RANK and LOCAL_WORLD_SIZE say which
    ranks share its host), and the store's host (rank 0's)."""
    last = flight.recent()["last"]
    ranks = flight.members(last[-1]["channel"]) if last else []
    per_host, host = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("GROUP_RANK", "-1"))
    lost = [r for r in ranks if r // per_host != host] if host >= 0 else [r for r in ranks if r != dist.get_rank()]
    if not lost:
        return "the store's host (rank 0's) is unreachable or stalled"
    return (
        f"lost rank(s) {', '.join(map(str, lost))}, which the collective it waits in needs, and the store on "
        "rank 0's host: that host or this one lost its network, or their processes died"
    )


def _waiting_in() -> str:
    """ "waiting in <op> #<seq> on <group>, " for this rank's last collective, or ""."""
    last = flight.recent()["last"]
    return f"waiting in {last[-1]['op']} #{last[-1]['seq']} on {last[-1]['group']}, " if last else ""


def _exit(line: str, linger_s: float = 0.0) -> None:
    """Write `line` to stderr and end the process with status 1 at once: a normal exit
    could wait on the broken process group. One write of the line and its newline, so that
    ranks sharing a pipe (torchrun's) do not interleave their sentences; `linger_s`: after
    it, time for the other ranks to read a sentence left in the store."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):  # a stderr with no descriptor (captured)
        print(line, file=sys.stderr, flush=True)
    time.sleep(linger_s)
    os._exit(1)
