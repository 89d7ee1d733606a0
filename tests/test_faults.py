"""Runs that go wrong end with a sentence and a non-zero exit, never a hang: a stalled rank
(named by the desync report), a loss that stays NaN, and fp16 steps that are skipped (the
LR schedule waits for them)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel import comm, desync, flight
from research.errors import NonFiniteLossError
from tests.conftest import TINY_RUN
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# The desync report
# ---------------------------------------------------------------------------


def _entry(op: str, group: str, channel: str, seq: int, t: float = 100.0) -> dict:
    return {"op": op, "group": group, "channel": channel, "seq": seq, "bytes": 8, "time": t}


def test_the_report_names_the_rank_behind_and_what_it_issued_last() -> None:
    records = {
        0: {"last": [_entry("all_reduce", "dp", "0,1,2,3", 7)], "issued": {"0,1,2,3": 7}},
        1: {"last": [_entry("all_reduce", "dp", "0,1,2,3", 7)], "issued": {"0,1,2,3": 7}},
        3: {"last": [_entry("all_reduce", "dp", "0,1,2,3", 7)], "issued": {"0,1,2,3": 7}},
        2: {"last": [_entry("broadcast", "tp", "2,3", 4, t=90.0)], "issued": {"0,1,2,3": 6, "2,3": 4}},
    }
    entry, behind = flight.missing_ranks(records[0], records)
    assert entry["seq"] == 7 and behind == [2]
    text = desync.report(0, records, 4, 5.0, now=105.0)
    head = text.splitlines()[0]
    assert head.startswith("a collective timed out after 5 s: rank(s) 2 did not arrive at all_reduce #7 on dp")
    assert "rank 2 last issued broadcast #4 on tp [2,3] (8 B, 15.0 s ago)" in head
    assert "  rank 2 (did not arrive): broadcast #4" in text


def test_a_rank_blocked_behind_the_stalled_one_is_not_blamed() -> None:
    """Rank 2 stalls; rank 0 waits for it on their tie group, so neither reaches the mp
    all-reduce rank 1 waits in: the report names rank 2 and says rank 0 waits for it."""
    records = {
        1: {"last": [_entry("all_reduce", "mp", "0,1,2,3", 9)], "issued": {"0,1,2,3": 9}},
        3: {"last": [_entry("all_reduce", "mp", "0,1,2,3", 9)], "issued": {"0,1,2,3": 9}},
        0: {"last": [_entry("all_reduce", "embedding", "0,2", 11)], "issued": {"0,1,2,3": 8, "0,2": 11}},
        2: {"last": [_entry("all_reduce", "embedding", "0,2", 10)], "issued": {"0,1,2,3": 8, "0,2": 10}},
    }
    text = desync.report(1, records, 4, 4.0, now=104.0)
    head = text.splitlines()[0]
    assert "rank(s) 2 did not arrive at all_reduce #9 on mp" in head and "rank 2 last issued" in head, head
    assert "rank 0 waits for rank 2 in all_reduce #11 on embedding [0,2]" in head, head
    assert "  rank 0 (waits for rank 2):" in text and "  rank 2 (did not arrive):" in text


def test_ranks_whose_heartbeat_stopped_are_named() -> None:
    """Every rank issued broadcast #8 (a link cut while all were in it): the sequence numbers
    blame no one, the heartbeats do: ranks 2 and 3 have not published for 12 s."""
    records = {
        r: {
            "last": [_entry("broadcast", "dp", "0,1,2,3", 8)],
            "issued": {"0,1,2,3": 8},
            "beat": 88.0 if r > 1 else 99.5,
        }
        for r in range(4)
    }
    text = desync.report(0, records, 4, 10.0, now=100.0)
    assert text.startswith("a collective timed out after 10 s on rank 0: rank(s) 2, 3 have been silent for 12 s"), text
    assert "  rank 2 (silent 12 s):" in text and "  rank 1:" in text


def test_a_store_that_stops_answering_ends_the_rank(monkeypatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(desync, "_exit", said.append)
    monkeypatch.setattr(desync, "PUBLISH_INTERVAL_S", 0.01)
    stop = __import__("threading").Event()
    desync._guard_store(3, stop, [time.monotonic() - 50.0], patience=40.0)  # returns once it has spoken
    assert len(said) == 1 and said[0].startswith("error: rank 3 lost contact with the rendezvous store"), said


def _group_timeouts() -> list[float]:
    """The timeouts of a group made after set_timeout, and of a side group of it."""
    from datetime import timedelta

    import torch

    desync.set_timeout(7.0, [None])
    group = __import__("torch.distributed", fromlist=["new_group"]).new_group([0, 1])
    side = flight.side_group(group)
    cpu = torch.device("cpu")
    out = [g._get_backend(cpu).options._timeout / timedelta(seconds=1) for g in (group, side)]
    return out


def test_groups_made_later_take_the_run_timeout() -> None:
    """torch gives a new group 30 minutes whatever the default group has: a rank that loses a
    peer while a group connects would wait that long."""
    for timeouts in run_distributed(_group_timeouts, 2, timeout=60):
        assert timeouts == [7.0, 7.0]


def test_a_rank_that_never_published_is_reported_missing() -> None:
    records = {0: {"last": [_entry("barrier", "world", "0,1", 1)], "issued": {"0,1": 1}}}
    _, behind = flight.missing_ranks(records[0], records)
    assert behind == [1]
    assert "rank 1 never reported" in desync.report(0, records, 2, None)
    assert "  rank 1: nothing published" in desync.report(0, records, 2, None)


def test_p2p_pairs_are_matched_by_direction() -> None:
    records = {
        0: {"last": [_entry("isend", "pp", "0->1", 3)], "issued": {"0->1": 3}},
        1: {"last": [_entry("irecv", "pp", "0->1", 2)], "issued": {"0->1": 2, "1->0": 5}},
    }
    entry, behind = flight.missing_ranks(records[0], records)
    assert entry["op"] == "isend" and behind == [1]


def test_when_every_rank_arrived_the_report_says_the_order_differs() -> None:
    records = {r: {"last": [_entry("all_reduce", "dp", "0,1", 2)], "issued": {"0,1": 2}} for r in (0, 1)}
    assert flight.missing_ranks(records[0], records) == (None, [])
    assert "waiting in different collectives" in desync.report(0, records, 2, 3.0)


def _record_some_collectives() -> dict:
    import torch
    import torch.distributed as dist

    flight.reset()
    comm.all_reduce(torch.ones(2))
    comm.barrier()
    peer = 1 - dist.get_rank()
    for work in comm.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.ones(1), peer), dist.P2POp(dist.irecv, torch.empty(1), peer)]
    ):
        work.wait()
    return flight.recent()


def test_the_flight_recorder_numbers_collectives_per_channel() -> None:
    rec0, rec1 = run_distributed(_record_some_collectives, 2, timeout=60)
    assert [(e["op"], e["channel"], e["seq"]) for e in rec0["last"]] == [
        ("all_reduce", "0,1", 1),
        ("barrier", "0,1", 2),
        ("isend", "0->1", 1),
        ("irecv", "1->0", 1),
    ]
    assert rec0["issued"] == {"0,1": 2, "0->1": 1, "1->0": 1}
    assert rec1["issued"] == rec0["issued"]
    assert rec0["last"][0]["bytes"] == 8


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _rank_pid(parent: int, rank: int) -> int:
    """The pid of torchrun's worker with RANK=rank."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for pid in map(int, children):
        if f"RANK={rank}" in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0"):
            return pid
    raise AssertionError(f"no worker with RANK={rank} among {children}")


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir() or not hasattr(signal, "SIGSTOP"), reason="needs Linux /proc and SIGSTOP"
)
@pytest.mark.timeout(180)
def test_a_stalled_rank_is_named_and_the_others_exit(tmp_path: Path) -> None:
    """SIGSTOP one of 4 workers mid-run: within --comm-timeout (+ a few s) the first rank to
    notice prints the report naming the stopped rank and exits 1; torchrun ends the rest."""
    out, log = tmp_path / "run", tmp_path / "log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",  # torchrun, of the Python running the tests
        "--standalone",
        "--nproc_per_node=4",
        "-m",
        "experiments.train",
        *TINY_RUN,
        "--tp",
        "2",
        "--pp",
        "2",
        "--micro-batches",
        "2",
        "--steps",
        "10000",
        "--comm-timeout",
        "4",
        "--out",
        str(out),
        "--data-cache",
        str(tmp_path / "cache"),
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    victim = None
    try:
        metrics = out / "metrics.jsonl"
        assert _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, 120), log.read_text()
        # a few publish periods while training: the rank to stop has published its record
        time.sleep(3 * desync.PUBLISH_INTERVAL_S)
        victim = _rank_pid(proc.pid, 2)
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        assert _wait_for(lambda: "did not arrive" in log.read_text(), 60), log.read_text()
        noticed = time.monotonic() - stopped
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=60)
    text = log.read_text()
    assert proc.returncode != 0
    report = next(line for line in text.splitlines() if line.startswith("error: a collective timed out"))
    assert "rank(s) 2 did not arrive at" in report and "rank 2 last issued" in report, report
    # a stopped process publishes no heartbeat either: once silent for 5 s it is named so too
    assert re.search(r"  rank 2 \(did not arrive\)( \(silent \d+ s\))?:", text), text
    assert noticed < 4 + 20, noticed
    assert not re.search(r"\[rank\d\]: Traceback", text), text  # no worker tracebacks (torchrun prints its own)


# ---------------------------------------------------------------------------
# NaN losses and skipped fp16 steps
# ---------------------------------------------------------------------------


def _train(argv: list[str]) -> tuple[str | None, list[dict]]:
    from experiments.train import run

    out = argv[argv.index("--out") + 1]
    try:
        run(argv)
        message = None
    except NonFiniteLossError as e:
        message = str(e)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return message, [json.loads(line) for line in f]


def test_a_loss_that_stays_nan_stops_the_run(tmp_path: Path) -> None:
    argv = [
        *TINY_RUN,
        "--steps",
        "20",
        "--lr",
        "1e9",
        "--clip-grad",
        "0",
        "--max-nonfinite-steps",
        "2",
        "--out",
        str(tmp_path / "run"),
        "--data-cache",
        str(tmp_path / "cache"),
        "--save",
        str(tmp_path / "ckpt"),
        "--save-every",
        "1",
    ]
    ((message, rows),) = run_distributed(_train, 1, argv, timeout=120)
    assert message is not None, [r["loss"] for r in rows]
    bad = [r["step"] for r in rows if r["loss"] is None]  # NaN is written as null
    assert len(bad) == 2 and rows[-1]["step"] == bad[-1] == bad[0] + 1 < 20
    assert f"for 2 consecutive step(s) up to step {bad[-1]} (--max-nonfinite-steps=2)" in message
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    assert saved[-1] == f"step_{bad[0] - 1:08d}", saved  # no checkpoint of a NaN model


def _train_with_overflowing_scale(argv: list[str]) -> tuple[str | None, list[dict]]:
    import optim.zero
    from optim import DynamicLossScaler

    # the scaler ZeroOptimizer makes for fp16 when the trainer's MixedPrecision names none
    optim.zero.DynamicLossScaler = functools.partial(DynamicLossScaler, init_scale=2.0**24, hysteresis=1)
    return _train(argv)


def test_a_skipped_fp16_step_does_not_advance_the_lr(tmp_path: Path) -> None:
    argv = [
        *TINY_RUN,
        "--steps",
        "8",
        "--precision",
        "fp16",
        "--warmup-steps",
        "4",
        "--lr",
        "1e-3",
        "--out",
        str(tmp_path / "run"),
        "--data-cache",
        str(tmp_path / "cache"),
    ]
    ((message, rows),) = run_distributed(_train_with_overflowing_scale, 1, argv, timeout=120)
    assert message is None
    skipped = [r["skipped"] for r in rows]
    assert skipped[0] and not skipped[-1], skipped  # the scale halves from 2^24 until gradients fit fp16
    taken = 0
    for row in rows:
        assert row["lr"] == pytest.approx(1e-3 * min(1.0, (taken + 1) / 4)), (row, rows)
        taken += not row["skipped"]
