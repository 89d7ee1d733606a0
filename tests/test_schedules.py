"""parallel/pipeline: schedules as data, their simulation against the papers' formulas,
and the timeline pictures. Pure Python, no process group.

Legend: p pp ranks, m micro-batches, v virtual stages per rank, t_f / t_b the forward /
backward time of one micro-batch on one rank, ideal time m(t_f+t_b).
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from parallel.pipeline import (
    SCHEDULES,
    Action,
    check_consistent,
    chrome_trace,
    schedule,
    simulate,
    stage_of,
    timeline_png,
    validate,
)
from parallel.pipeline.schedules import ScheduleError, register, splits_backward
from parallel.pipeline.simulate import peak_in_flight

GRID = [
    (name, p, k * p, v)
    for name in SCHEDULES
    for p in (1, 2, 4, 8)
    for k in (1, 2, 4, 8)
    for v in ((1, 2) if SCHEDULES[name].interleaved else (1,))
]
T_F, T_B = 1.0, 2.0


def bubble_over_ideal(name, p, m, v=1, **kw):
    r = simulate(name, p, m, v, t_forward=T_F, t_backward=T_B, **kw)
    ideal = m * (T_F + T_B)
    return (r.makespan - ideal) / ideal, r


@pytest.mark.parametrize("name, p, m, v", GRID)
def test_consistent_and_complete(name, p, m, v):
    check_consistent(name, p, m, v)  # SEND/RECV pairing and order, F < B < W
    want = Counter(
        (k, i, c) for k in ("FBW" if SCHEDULES[name].split_backward else "FB") for i in range(m) for c in range(v)
    )
    last = p * v - 1
    for r in range(p):
        plan = schedule(name, p, r, m, v)
        assert Counter((a.kind, a.microbatch, a.chunk) for a in plan if a.kind in "FBW") == want
        comm = Counter(a.kind for a in plan if a.kind not in "FBW")
        n_first = sum(stage_of(r, c, p) == 0 for c in range(v))  # chunks that are stage 0
        n_last = sum(stage_of(r, c, p) == last for c in range(v))
        assert comm["RECV_F"] == comm["SEND_B"] == m * (v - n_first)
        assert comm["SEND_F"] == comm["RECV_B"] == m * (v - n_last)


@pytest.mark.parametrize("name, p, m, v", GRID)
def test_comm_is_adjacent_to_compute(name, p, m, v):
    """Each RECV is followed by the compute it feeds; each SEND follows the compute it ships."""
    for r in range(p):
        plan = schedule(name, p, r, m, v)
        for i, a in enumerate(plan):
            if a.kind.startswith("RECV"):
                assert plan[i + 1] == Action(a.kind[-1], a.microbatch, a.chunk)
            if a.kind.startswith("SEND"):
                assert plan[i - 1] == Action(a.kind[-1], a.microbatch, a.chunk)


@pytest.mark.parametrize("name, p, m, v", [g for g in GRID if g[0] != "zb-h1"])
def test_bubble_formula(name, p, m, v):
    """GPipe / 1F1B: bubble/ideal = (p-1)/m, i.e. (p-1)/(m+p-1) of the makespan;
    interleaved 1F1B: (p-1)/(v·m)."""
    ratio, r = bubble_over_ideal(name, p, m, v)
    assert ratio == pytest.approx((p - 1) / (v * m), abs=1e-12)
    if v == 1:
        assert r.idle_fraction == pytest.approx([(p - 1) / (m + p - 1)] * p)


@pytest.mark.parametrize("p, m", [(p, k * p) for p in (1, 2, 4, 8) for k in (1, 2, 4, 8)])
def test_peak_in_flight(p, m):
    assert simulate("1f1b", p, m).peak_in_flight == [min(p - r, m) for r in range(p)]
    assert simulate("gpipe", p, m).peak_in_flight == [m] * p
    zb = simulate("zb-h1", p, m).peak_in_flight
    assert max(zb) == p and all(x <= p for x in zb)  # ZB-H1: never above 1F1B's peak (rank 0)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_in_flight_closed_form_equals_the_order(name):
    """Each schedule's closed-form in-flight peak (what the planner's memory uses) equals the
    peak read off its order, on every rank, for every valid (p, m, v) of a grid."""
    checked = 0
    for p, v, m in itertools.product(range(1, 9), range(1, 5), range(1, 40)):
        try:
            validate(name, p, m, v)
        except ScheduleError:
            continue
        for r in range(p):
            order = SCHEDULES[name](p, r, m, v)
            assert SCHEDULES[name].in_flight(p, r, m, v) == peak_in_flight(order, splits_backward(name)), (p, r, m, v)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("p, m", [(p, k * p) for p in (2, 4, 8) for k in (1, 2, 4, 8)])
@pytest.mark.parametrize("t_weight", [0.5, 1.0])
def test_zb_h1_bubble(p, m, t_weight):
    """ZB-H1 bubble (p-1)(t_f + t_B - t_W) with t_B = t_b - t_W the input-grad pass (Qi et al.,
    for t_W <= t_B), against 1F1B's (p-1)(t_f + t_b)."""
    ratio, _ = bubble_over_ideal("zb-h1", p, m, t_weight=t_weight)
    one_f_one_b, _ = bubble_over_ideal("1f1b", p, m)
    assert ratio < one_f_one_b
    assert ratio * m * (T_F + T_B) == pytest.approx((p - 1) * (T_F + T_B - 2 * t_weight))


def test_interleaved_placement_and_peers():
    assert [stage_of(r, c, 4) for c in range(2) for r in range(4)] == list(range(8))
    plan = schedule("interleaved-1f1b", 4, 3, 4, 2)  # last rank: chunk 0 feeds rank 0 chunk 1
    assert Action("SEND_F", 0, 0, 0) in plan and Action("RECV_B", 0, 0, 0) in plan
    assert not any(a.kind in ("SEND_F", "RECV_B") and a.chunk == 1 for a in plan)  # stage 7 is last
    first = schedule("interleaved-1f1b", 4, 0, 4, 2)
    assert Action("RECV_F", 0, 1, 3) in first and not any(a.kind == "RECV_F" and a.chunk == 0 for a in first)


def test_comm_time_lengthens_run():
    for name in SCHEDULES:
        assert simulate(name, 4, 8, t_comm=0.1).makespan > simulate(name, 4, 8).makespan


def test_deadlock_is_reported():
    @register("bad-backward-first", in_flight=lambda pp, rank, m, v: m)
    def bad(pp, rank, m, v):  # rank 0 waits for a gradient, rank 1 for an activation
        if rank > 0:
            return SCHEDULES["gpipe"](pp, rank, m, v)
        return [Action("B", i) for i in range(m)] + [Action("F", i) for i in range(m)]

    try:
        with pytest.raises(
            RuntimeError,
            match=r"deadlock in bad-backward-first .*rank 0 waits at RECV_B0.0@1; rank 1 waits at RECV_F0.0@0",
        ):
            simulate("bad-backward-first", 2, 2)
        with pytest.raises(ValueError, match="out of order"):
            check_consistent("bad-backward-first", 2, 2)
    finally:
        del SCHEDULES["bad-backward-first"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("pipedream", 2, 4, 1),
            "unknown pipeline schedule 'pipedream'; known schedules: gpipe, 1f1b, interleaved-1f1b, zb-h1.",
        ),
        (("1f1b", 4, 2, 1), "1f1b with pp=4 needs at least 4 micro-batches, got 2."),
        (("zb-h1", 8, 4, 1), "zb-h1 with pp=8 needs at least 8 micro-batches, got 4."),
        (("interleaved-1f1b", 4, 2, 2), "interleaved-1f1b with pp=4 needs at least 4 micro-batches, got 2."),
        (("interleaved-1f1b", 4, 6, 2), "interleaved-1f1b with pp=4 needs micro-batches divisible by 4, got 6."),
        (("1f1b", 2, 4, 2), "1f1b does not interleave, so virtual_stages must be 1, got 2 (use interleaved-1f1b)."),
        (("gpipe", 0, 4, 1), "pp=0 must be a positive integer."),
        (("gpipe", 2, 2.0, 1), "microbatches=2.0 must be a positive integer."),
        (("gpipe", 2, 4, True), "virtual_stages=True must be a positive integer."),
    ],
)
def test_validate_errors(args, message):
    with pytest.raises(ValueError) as e:
        validate(*args)
    assert str(e.value) == message
    with pytest.raises(ValueError):
        schedule(args[0], args[1], 0, *args[2:])


def test_gpipe_allows_few_microbatches():
    validate("gpipe", 4, 2)
    assert simulate("gpipe", 4, 2).makespan == pytest.approx((2 + 3) * 3.0)


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_timeline_png_and_trace(tmp_path, name, v):
    result = simulate(name, 4, 8, v)
    png = tmp_path / "t.png"
    timeline_png(result, str(png), title=f"{name} p=4 m=8 v={v}")
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    timeline_png(result.events, str(tmp_path / "events.png"))  # raw event list works too
    chrome_trace(result, str(tmp_path / "t.json"))
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    xs = [e for e in trace if e["ph"] == "X"]
    assert len(xs) == len(result.events) == 4 * 8 * v * (3 if name == "zb-h1" else 2)
    for e, (rank, kind, mb, chunk, start, end) in zip(xs, result.events):
        assert (e["pid"], e["cat"], e["args"]["microbatch"], e["args"]["chunk"]) == (rank, kind, mb, chunk)
        assert e["ts"] == pytest.approx(start * 1e6) and e["dur"] == pytest.approx((end - start) * 1e6)
    assert {e["pid"] for e in trace if e["ph"] == "M"} == set(range(4))
