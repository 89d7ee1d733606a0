"""Discrete-event simulation of a pipeline schedule: run every rank's action list against
fixed compute and communication times and measure makespan, idle time and memory.

Cost model (per rank, per virtual stage): F takes t_f/v, B takes t_b/v (a chunk holds 1/v of
the layers). For split-backward schedules (zb-h1) B is the input gradient, t_b - t_w, and W
the weight gradient, t_w (default t_w = t_b/2). A SEND is non-blocking; its message arrives
at the producer's compute end + t_comm. A compute action starts when its rank is free and
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
    plans = [schedule(name, pp, r, microbatches, v) for r in range(pp)]
    if t_weight is None:
        t_weight = t_backward / 2 if split else 0.0
    cost = {"F": t_forward / v, "B": (t_backward - (t_weight if split else 0.0)) / v, "W": t_weight / v}
    channels = defaultdict(deque)  # (sender, receiver, F|B) -> deque of (mb, recv_chunk, arrival)
    clock, busy, pc = [0.0] * pp, [0.0] * pp, [0] * pp
    ready = [0.0] * pp  # latest arrival among RECVs since the last compute
    last_end = [0.0] * pp  # end of the last compute (what a SEND ships)
    events = []
    while True:
        progressed = False
        for r in range(pp):
            while pc[r] < len(plans[r]):
                a = plans[r][pc[r]]
                if a.kind.startswith("RECV"):
                    q = channels[a.peer, r, a.kind[-1]]
                    if not q:
                        break  # wait for the peer's SEND
                    mb, chunk, arrival = q.popleft()
                    if (mb, chunk) != (a.microbatch, a.chunk):
                        raise RuntimeError(
                            f"rank {r} expected {a} but rank {a.peer} sent micro-batch {mb} chunk {chunk}."
                        )
                    ready[r] = max(ready[r], arrival)
                elif a.kind.startswith("SEND"):
                    s = stage_of(r, a.chunk, pp) + (1 if a.kind == "SEND_F" else -1)
                    channels[r, a.peer, a.kind[-1]].append(
                        (a.microbatch, rank_chunk_of(s, pp)[1], last_end[r] + t_comm)
                    )
                else:
                    start = max(clock[r], ready[r])
                    end = start + cost[a.kind]
                    events.append((r, a.kind, a.microbatch, a.chunk, start, end))
                    clock[r] = last_end[r] = end
                    busy[r] += end - start
                    ready[r] = 0.0
                pc[r] += 1
                progressed = True
        if all(pc[r] == len(plans[r]) for r in range(pp)):
            break
        if not progressed:
            stuck = "; ".join(f"rank {r} waits at {plans[r][pc[r]]}" for r in range(pp) if pc[r] < len(plans[r]))
            raise RuntimeError(f"deadlock in {name} (pp={pp}, m={microbatches}, v={v}): {stuck}.")
    makespan = max(clock)
    return SimResult(
        makespan=makespan,
        idle_fraction=[1.0 - b / makespan if makespan else 0.0 for b in busy],
        peak_in_flight=[peak_in_flight(p, split) for p in plans],
        events=sorted(events, key=lambda e: (e[4], e[0])),
    )
