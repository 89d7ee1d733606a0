"""Discrete-event simulation of a pipeline schedule: run every rank's action list against
fixed compute and communication times and measure makespan, idle time and memory.

Cost model (per rank, per virtual stage): F takes t_f/v, B takes t_b/v (a chunk holds 1/v of
the layers). For split-backward schedules (zb-h1) B is the input gradient, t_b - t_w, and W
the weight gradient, t_w (default t_w = t_b/2). A SEND is non-blocking; its message leaves
at the producer's compute end, once the link (sender, receiver, direction) has delivered the
one before it, and arrives t_comm later. A compute action starts when its rank is free and
its RECVs have arrived. Busy time per rank is m·(t_f+t_b) for every schedule, so

    makespan = m·(t_f+t_b) + bubble,   idle_fraction[r] = 1 - busy[r] / makespan.

Memory: ``peak_in_flight[r]`` is the largest number of (micro-batch, chunk) pairs whose F
has run on r but whose last backward piece (B, or W when split) has not: the activations
the rank must hold.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from parallel.pipeline.schedules import (
    Action,
    rank_chunk_of,
    schedule,
    splits_backward,
    stage_of,
)

Event = tuple  # (rank, kind, microbatch, chunk, start_s, end_s)


@dataclass
class SimResult:
    makespan: float
    idle_fraction: list[float]
    peak_in_flight: list[int]
    events: list[Event] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the whole run, averaged over ranks: (p-1)/(m+p-1) for 1F1B."""
        return sum(self.idle_fraction) / len(self.idle_fraction)


def peak_in_flight(plan, split_backward: bool) -> int:
    """Max over the plan of #(micro-batch, chunk) with F done and last backward piece not."""
    last = "W" if split_backward else "B"
    live = peak = 0
    for a in plan:
        live += (a.kind == "F") - (a.kind == last)
        peak = max(peak, live)
    return peak


def simulate(
    name: str,
    pp: int,
    microbatches: int,
    virtual_stages: int = 1,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float | None = None,
    t_comm: float = 0.0,
) -> SimResult:
    """Run all ranks' lists of ``schedule(name, ...)``; raise RuntimeError on a deadlock
    (no rank can progress) naming each stuck rank's next action."""
    v, split = virtual_stages, splits_backward(name)
    if t_weight is None:
        t_weight = t_backward / 2 if split else 0.0
    cost = {"F": t_forward / v, "B": (t_backward - (t_weight if split else 0.0)) / v, "W": t_weight / v}
    ranks = _Ranks([schedule(name, pp, r, microbatches, v) for r in range(pp)], cost, t_comm)
    while not ranks.done():
        progressed = [ranks.advance(r) for r in range(pp)]
        if not any(progressed):
            raise RuntimeError(f"deadlock in {name} (pp={pp}, m={microbatches}, v={v}): {ranks.stuck()}.")
    makespan = max(ranks.clock)
    return SimResult(
        makespan=makespan,
        idle_fraction=[1.0 - b / makespan if makespan else 0.0 for b in ranks.busy],
        peak_in_flight=[peak_in_flight(p, split) for p in ranks.plans],
        events=sorted(ranks.events, key=lambda e: (e[4], e[0])),
    )


class _Ranks:
    """Every rank's place in its action list and clock. A SEND ships the end time of the
    rank's last compute (+ t_comm) into a channel; a compute starts at max(its clock, the
    latest arrival among the RECVs since its last compute)."""

    def __init__(self, plans: list[list[Action]], cost: dict[str, float], t_comm: float) -> None:
        self.plans, self.cost, self.t_comm = plans, cost, t_comm
        self.pp = pp = len(plans)
        self.channels: dict = defaultdict(deque)  # (sender, receiver, F|B) -> deque of (mb, recv_chunk, arrival)
        self.clock, self.busy, self.pc = [0.0] * pp, [0.0] * pp, [0] * pp
        self.link_free: dict = defaultdict(float)  # (sender, receiver, F|B) -> its last message's arrival
        self.ready = [0.0] * pp  # latest arrival among RECVs since the last compute
        self.last_end = [0.0] * pp  # end of the last compute (what a SEND ships)
        self.events: list[tuple[int, str, int, int, float, float]] = []

    def done(self) -> bool:
        return all(pc == len(plan) for pc, plan in zip(self.pc, self.plans))

    def stuck(self) -> str:
        return "; ".join(
            f"rank {r} waits at {self.plans[r][self.pc[r]]}" for r in range(self.pp) if self.pc[r] < len(self.plans[r])
        )

    def advance(self, r: int) -> bool:
        """Run rank r's actions until it waits for a SEND or has none left; whether it moved."""
        start_pc = self.pc[r]
        while self.pc[r] < len(self.plans[r]):
            a = self.plans[r][self.pc[r]]
            if a.kind.startswith("RECV"):
                if not self._receive(r, a):
                    break
            elif a.kind.startswith("SEND"):
                s = stage_of(r, a.chunk, self.pp) + (1 if a.kind == "SEND_F" else -1)
                link = (r, a.peer, a.kind[-1])
                arrival = self.link_free[link] = max(self.last_end[r], self.link_free[link]) + self.t_comm
                self.channels[link].append((a.microbatch, rank_chunk_of(s, self.pp)[1], arrival))
            else:
                start = max(self.clock[r], self.ready[r])
                end = start + self.cost[a.kind]
                self.events.append((r, a.kind, a.microbatch, a.chunk, start, end))
                self.clock[r] = self.last_end[r] = end
                self.busy[r] += end - start
                self.ready[r] = 0.0
            self.pc[r] += 1
        return self.pc[r] > start_pc

    def _receive(self, r: int, a: Action) -> bool:
        """Take `a`'s message if it was sent (checking it is the one expected); whether it was."""
        q = self.channels[a.peer, r, a.kind[-1]]
        if not q:
            return False
        mb, chunk, arrival = q.popleft()
        if (mb, chunk) != (a.microbatch, a.chunk):
            raise RuntimeError(f"rank {r} expected {a} but rank {a.peer} sent micro-batch {mb} chunk {chunk}.")
        self.ready[r] = max(self.ready[r], arrival)
        return True
