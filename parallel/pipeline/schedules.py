"""Pipeline schedules as data: each pp rank gets a list of ``Action``s to run in order.

Notation: p = pp ranks, m = micro-batches, v = virtual stages (model chunks) per rank,
S = p·v virtual stages. Rank r holds stages r, r+p, r+2p, ... (``stage_of``), as in
Megatron's interleaved placement (Narayanan et al. 2021, §2.2.2).

Schedules (with t_f, t_b the forward / backward time of one micro-batch on one rank):

- ``gpipe``: all m forwards, then all m backwards. Bubble (p-1)(t_f+t_b), i.e.
  (p-1)/m of the ideal time m(t_f+t_b); m activations in flight.
- ``1f1b``: rank r runs min(p-r-1, m) warm-up forwards, then alternates one forward and
  one backward, then drains the remaining backwards. Same bubble as GPipe, but at most
  p-r micro-batches in flight on rank r (PipeDream-Flush).
- ``interleaved-1f1b``: 1F1B over v chunks per rank, micro-batches in groups of p
  (Megatron's rule m % p == 0). Each chunk costs t_f/v, t_b/v, so the bubble shrinks to
  (p-1)(t_f+t_b)/v, i.e. (p-1)/(v·m) of the ideal time.
- ``zb-h1``: 1F1B with the backward split into B (input gradient, sent upstream at once)
  and W (weight gradient). Rank r postpones its first r W's; the pending W's fill the
  cool-down bubble (Qi et al. 2023, ZB-H1). No rank ever holds more than p micro-batches,
  the peak of 1F1B's rank 0; bubble (p-1)(t_f + t_B - t_W) instead of (p-1)(t_f+t_B+t_W)
  (for t_W <= t_B; the simulation checks it).

Communication is explicit: RECV_F/RECV_B right before the compute that consumes it, SEND_F/
SEND_B right after the compute that produces it. The first virtual stage receives no
activations, the last receives no gradient (its backward starts from the loss). A SEND's
``chunk`` is the sender's chunk, a RECV's the receiver's. With p == 1 and v > 1, ``peer`` is
the rank itself: a local hand-off between chunks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

COMPUTE = ("F", "B", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    kind: str  # F, B, W, SEND_F, RECV_F, SEND_B, RECV_B
    microbatch: int
    chunk: int = 0  # model chunk on this rank, 0..v-1
    peer: int | None = None  # pp rank of the peer, for SEND / RECV

    def __repr__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.kind}{self.microbatch}.{self.chunk}{peer}"


def stage_of(rank: int, chunk: int, pp: int) -> int:
    """Global virtual stage of (rank, chunk): chunk·pp + rank."""
    return chunk * pp + rank


def rank_chunk_of(stage: int, pp: int) -> tuple[int, int]:
    """Inverse of ``stage_of``: (rank, chunk) = (stage mod pp, stage div pp)."""
    return stage % pp, stage // pp


# ---------------------------------------------------------------------------
# Compute orders (F / B / W only); registered in SCHEDULES
# ---------------------------------------------------------------------------

SCHEDULES: dict[str, Callable[[int, int, int, int], list[Action]]] = {}


def register(
    name: str,
    *,
    in_flight: Callable[[int, int, int, int], int],
    interleaved=False,
    needs_m_ge_pp=False,
    needs_m_div_pp=False,
    split_backward=False,
):
    """Add a compute-order builder ``fn(pp, rank, m, v) -> [Action]`` to SCHEDULES; the flags
    drive ``validate`` and tell executors whether B is split into B + W. ``in_flight(pp, rank,
    m, v)``: the order's peak of (micro-batch, chunk) pairs whose F ran and whose last backward
    piece did not, in closed form (`simulate.peak_in_flight` of the order, without building it)."""

    def deco(fn):
        fn.interleaved, fn.needs_m_ge_pp, fn.needs_m_div_pp = interleaved, needs_m_ge_pp, needs_m_div_pp
        fn.split_backward, fn.in_flight = split_backward, in_flight
        SCHEDULES[name] = fn
        return fn

    return deco


def _interleaved_warmup(pp: int, rank: int, m: int, v: int) -> int:
    total = m * v
    return total if m == pp else min(2 * (pp - rank - 1) + (v - 1) * pp, total)


@register("gpipe", in_flight=lambda pp, rank, m, v: m)  # every forward before any backward
def _gpipe(pp: int, rank: int, m: int, v: int) -> list[Action]:
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


# warm-up forwards, then one more before each backward
@register("1f1b", in_flight=lambda pp, rank, m, v: min(pp - rank, m), needs_m_ge_pp=True)
def _one_f_one_b(pp: int, rank: int, m: int, v: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    ops = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: F of micro-batch warmup+i, B of i
        ops += [Action("F", warmup + i), Action("B", i)]
    ops += [Action("B", i) for i in range(m - warmup, m)]
    return ops


@register(
    "interleaved-1f1b",
    in_flight=lambda pp, rank, m, v: (
        min(_interleaved_warmup(pp, rank, m, v) + 1, m * v) if v > 1 else min(pp - rank, m)
    ),
    interleaved=True,
    needs_m_ge_pp=True,
    needs_m_div_pp=True,
)
def _interleaved(pp: int, rank: int, m: int, v: int) -> list[Action]:
    """Megatron's order: the k-th forward runs chunk (k // p) % v on micro-batch
    (k // (p·v))·p + k % p; backwards walk the chunks in reverse. Warm-up has
    2(p-r-1) + (v-1)p forwards (all m·v when m == p). With v == 1 it is plain 1F1B."""
    if v == 1:
        return _one_f_one_b(pp, rank, m, v)
    total = m * v

    def action(kind: str, k: int) -> Action:
        chunk = (k % (pp * v)) // pp
        mb = (k // (pp * v)) * pp + k % pp
        return Action(kind, mb, chunk if kind == "F" else v - 1 - chunk)

    warmup = _interleaved_warmup(pp, rank, m, v)
    ops = [action("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [action("F", warmup + i), action("B", i)]
    ops += [action("B", k) for k in range(total - warmup, total)]
    return ops


# each rank defers its W's until r are pending: every rank holds min(p, m)
@register("zb-h1", in_flight=lambda pp, rank, m, v: min(pp, m), needs_m_ge_pp=True, split_backward=True)
def _zb_h1(pp: int, rank: int, m: int, v: int) -> list[Action]:
    """1F1B order of F and B (input grad); each B is followed by the W of the oldest pending
    micro-batch once rank r has r W's pending; the rest run at the end (the cool-down)."""
    ops, pending = [], []
    for a in _one_f_one_b(pp, rank, m, v):
        ops.append(a)
        if a.kind == "B":
            pending.append(a.microbatch)
            if len(pending) > rank:
                ops.append(Action("W", pending.pop(0)))
    return ops + [Action("W", i) for i in pending]


# ---------------------------------------------------------------------------
# Validation, communication, the public entry point
# ---------------------------------------------------------------------------


class ScheduleError(ValueError):
    """A (schedule, pp, micro-batches, virtual stages) that cannot run; `field` names the
    argument at fault: "schedule", "pp", "microbatches" or "virtual_stages"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def validate(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ScheduleError with one sentence if (name, pp, m, v) cannot run."""
    for key, val in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ScheduleError(key, f"{key}={val!r} must be a positive integer.")
    if name not in SCHEDULES:
        raise ScheduleError("schedule", f"unknown pipeline schedule {name!r}; known schedules: {', '.join(SCHEDULES)}.")
    fn, m, v = SCHEDULES[name], microbatches, virtual_stages
    if v > 1 and not fn.interleaved:
        raise ScheduleError(
            "virtual_stages",
            f"{name} does not interleave, so virtual_stages must be 1, got {v} "
            f"(use {', '.join(k for k, f in SCHEDULES.items() if f.interleaved)}).",
        )
    if fn.needs_m_ge_pp and m < pp:
        raise ScheduleError("microbatches", f"{name} with pp={pp} needs at least {pp} micro-batches, got {m}.")
    if fn.needs_m_div_pp and m % pp:
        raise ScheduleError("microbatches", f"{name} with pp={pp} needs micro-batches divisible by {pp}, got {m}.")


def _with_comms(compute: list[Action], pp: int, rank: int, v: int) -> list[Action]:
    last = pp * v - 1
    out = []
    for a in compute:
        s = stage_of(rank, a.chunk, pp)
        prev, nxt = rank_chunk_of(s - 1, pp)[0], rank_chunk_of(s + 1, pp)[0]
        if a.kind == "F" and s > 0:
            out.append(Action("RECV_F", a.microbatch, a.chunk, prev))
        if a.kind == "B" and s < last:
            out.append(Action("RECV_B", a.microbatch, a.chunk, nxt))
        out.append(a)
        if a.kind == "F" and s < last:
            out.append(Action("SEND_F", a.microbatch, a.chunk, nxt))
        if a.kind == "B" and s > 0:
            out.append(Action("SEND_B", a.microbatch, a.chunk, prev))
    return out


def schedule(name: str, pp: int, rank: int, microbatches: int, virtual_stages: int = 1) -> list[Action]:
    """The complete action list of ``rank`` (compute and point-to-point communication)."""
    validate(name, pp, microbatches, virtual_stages)
    if not (isinstance(rank, int) and 0 <= rank < pp):
        raise ValueError(f"rank={rank!r} must be an integer in [0, {pp}).")
    compute = SCHEDULES[name](pp, rank, microbatches, virtual_stages)
    return _with_comms(compute, pp, rank, virtual_stages)


def splits_backward(name: str) -> bool:
    """True if the schedule runs B (input grad) and W (weight grad) as separate actions."""
    return SCHEDULES[name].split_backward


def check_consistent(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError unless the ranks' lists fit together: each rank runs every F, B (and W
    for split-backward schedules) of every (micro-batch, chunk) exactly once, B after F, W
    after B; and for each (sender, receiver, kind) the SENDs on the sender and the RECVs on
    the receiver name the same (micro-batch, receiving chunk) in the same order."""
    m, v = microbatches, virtual_stages
    plans = [schedule(name, pp, r, m, v) for r in range(pp)]
    kinds = ("F", "B", "W") if splits_backward(name) else ("F", "B")
    sent, recvd = defaultdict(list), defaultdict(list)
    for r, plan in enumerate(plans):
        pos = {}
        for i, a in enumerate(plan):
            if a.kind in COMPUTE:
                if (a.kind, a.microbatch, a.chunk) in pos:
                    raise ValueError(f"rank {r} runs {a} twice in {name}.")
                pos[a.kind, a.microbatch, a.chunk] = i
            elif a.kind.startswith("SEND"):
                s = stage_of(r, a.chunk, pp) + (1 if a.kind == "SEND_F" else -1)
                sent[r, a.peer, a.kind[-1]].append((a.microbatch, rank_chunk_of(s, pp)[1]))
            else:
                recvd[a.peer, r, a.kind[-1]].append((a.microbatch, a.chunk))
        want = {(k, i, c) for k in kinds for i in range(m) for c in range(v)}
        if set(pos) != want:
            raise ValueError(f"rank {r} of {name} runs {sorted(set(pos) ^ want)} wrongly (missing or extra).")
        for i in range(m):
            for c in range(v):
                if not pos["F", i, c] < pos["B", i, c] < pos.get(("W", i, c), len(plan)):
                    raise ValueError(f"rank {r} of {name} runs micro-batch {i} chunk {c} out of order F < B < W.")
    for key in set(sent) | set(recvd):
        if sent[key] != recvd[key]:
            raise ValueError(
                f"{name}: rank {key[0]} sends {key[2]} to rank {key[1]} as {sent[key]} "
                f"but rank {key[1]} receives {recvd[key]}."
            )
