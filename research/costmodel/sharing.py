"""A pipeline step on cores its ranks share (an emulated cluster: many processes on a few
cores), simulated with processor sharing.

Each pp rank stands for the k processes of its stage, which compute together. While n
stages compute, each computes `share(n)` times slower than alone (`Cluster.group_share` of
their n·k processes), so a stage alone in the warm-up or cool-down runs faster than in the
steady state, and neither bound alone (the critical path at one rate, the cores' work at
the slowest) is the step. A compute action is its compute, then its TP / expert calls;
the calls take their own time and hold a share of the cores only where `calls_use_cores`
(the group inside a host). Sends leave when the compute before them ends, one at a time
on a link, and arrive `t_comm` later, as in `parallel.pipeline.simulate`.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable

from parallel.pipeline.schedules import schedule, splits_backward

_DONE = 1e-12  # seconds left under which an action counts as finished


def shared_makespan(
    name: str,
    pp: int,
    microbatches: int,
    virtual_stages: int,
    work: tuple[float, float],
    calls: tuple[float, float],
    t_comm: float,
    share: Callable[[int], float],
    calls_use_cores: bool,
) -> float:
    """Seconds of the schedule's step: `work` (forward, backward) is one micro-batch's
    compute on a rank alone, `calls` its TP / expert calls, split over the v chunks as
    `parallel.pipeline.simulate` splits them (zb-h1: W half the backward's compute)."""
    v, split = virtual_stages, splits_backward(name)
    t_w = work[1] / 2 if split else 0.0
    cost = {"F": (work[0] / v, calls[0] / v), "B": ((work[1] - t_w) / v, calls[1] / v), "W": (t_w / v, 0.0)}
    run = _Run([schedule(name, pp, r, microbatches, v) for r in range(pp)], cost, t_comm)
    while True:
        run.start_what_can_start()
        if run.finished():
            return run.now
        working = [r for r in range(pp) if run.left[r] is not None]
        computing = [r for r in working if run.left[r][0] > 0]
        busy = len(computing) + (calls_use_cores and len(working) - len(computing))
        rate = 1 / share(busy) if busy else 1.0
        dt = min([run.left[r][0] / rate if r in computing else run.left[r][1] for r in working] + [run.next_arrival()])
        if math.isinf(dt):
            raise RuntimeError(f"deadlock in {name} (pp={pp}, m={microbatches}, v={v}): {run.stuck()}.")
        run.advance(dt, rate, computing, working)


class _Run:
    """Every rank's place in its action list, what is left of its running action (compute,
    calls), the messages on each link, and the clock."""

    def __init__(self, plans: list[list], cost: dict[str, tuple[float, float]], t_comm: float) -> None:
        self.plans, self.cost, self.t_comm = plans, cost, t_comm
        self.pc = [0] * len(plans)
        self.left: list[list[float] | None] = [None] * len(plans)
        self.channels: dict = defaultdict(deque)  # (sender, receiver, F|B) -> arrival times
        self.link_free: dict = defaultdict(float)
        self.now = 0.0

    def start_what_can_start(self) -> None:
        """Run every idle rank's sends and arrived receives up to its next compute, until
        no rank moves (a send lets a rank before it in the sweep go on)."""
        moved = True
        while moved:
            moved = False
            for r, plan in enumerate(self.plans):
                while self.left[r] is None and self.pc[r] < len(plan) and self._step(r, plan[self.pc[r]]):
                    self.pc[r] += 1
                    moved = True

    def _step(self, r: int, a) -> bool:
        if a.kind.startswith("RECV"):
            q = self.channels[a.peer, r, a.kind[-1]]
            if not q or q[0] > self.now + _DONE:
                return False
            q.popleft()
        elif a.kind.startswith("SEND"):
            link = (r, a.peer, a.kind[-1])
            self.link_free[link] = max(self.now, self.link_free[link]) + self.t_comm
            self.channels[link].append(self.link_free[link])
        else:
            self.left[r] = list(self.cost[a.kind])
        return True

    def finished(self) -> bool:
        return all(left is None and pc == len(p) for left, pc, p in zip(self.left, self.pc, self.plans))

    def next_arrival(self) -> float:
        """Seconds until the first message still on its way to a rank that waits for it."""
        waiting = [self.channels[a.peer, r, a.kind[-1]] for r, a in self._heads() if a.kind.startswith("RECV")]
        return min((q[0] - self.now for q in waiting if q), default=math.inf)

    def _heads(self) -> list[tuple[int, object]]:
        return [(r, p[self.pc[r]]) for r, p in enumerate(self.plans) if self.left[r] is None and self.pc[r] < len(p)]

    def stuck(self) -> str:
        return "; ".join(f"rank {r} waits at {a}" for r, a in self._heads())

    def advance(self, dt: float, rate: float, computing: list[int], working: list[int]) -> None:
        for r in working:
            left = self.left[r]
            if r in computing:
                left[0] = max(0.0, left[0] - dt * rate)
            else:
                left[1] = max(0.0, left[1] - dt)
            if left[0] <= _DONE and left[1] <= _DONE:
                self.left[r] = None
        self.now += dt
