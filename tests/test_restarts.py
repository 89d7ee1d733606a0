"""A restartable job: one command, `torchrun --max-restarts 1 ... --resume ROOT`, with one
worker killed (SIGKILL) at each moment of a step (`tests/fault_job.py`), comes back from the
last complete checkpoint and finishes with exit 0; metrics.jsonl then holds each step once,
with the uninterrupted run's loss (ZeRO-3 with real units on 2 gloo ranks, fp32)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.conftest import TINY_RUN
from tests.timing import allow

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY = 12, 4
JOB = [
    *TINY_RUN,
    *("--steps", str(STEPS), "--zero", "3", "--unit-numel", "3000", "--comm-timeout", "20", "--save-every", str(EVERY)),
]


def launch(tmp: Path, name: str, *fault: str) -> subprocess.Popen:
    """The job under torchrun (with one restart), killed as `fault` says (none: not at all)."""
    module = ["-m", "tests.fault_job", *fault, "--"] if fault else ["-m", "experiments.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    job = [*JOB, "--out", str(tmp / name), "--resume", str(tmp / name / "ckpt"), "--data-cache", str(tmp / "cache")]
    return subprocess.Popen(
        [*cmd, *module, *job], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen, tmp: Path, name: str) -> tuple[int, str, list[dict]]:
    """(exit code, output, metrics rows) of a job `launch` began; killed after 240 s."""
    try:
        text = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    metrics = tmp / name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return proc.returncode, text, rows


def torchrun(tmp: Path, name: str, *fault: str) -> tuple[int, str, list[dict]]:
    return finish(launch(tmp, name, *fault), tmp, name)


MOMENTS = [("forward", 6), ("backward", 6), ("step", 6), ("save", 7), ("between", 5)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted job ("whole") and one killed at each of MOMENTS, all at once (their
    losses, not their times, are compared): name -> (exit code, output, rows, folder)."""
    tmps = {key: tmp_path_factory.mktemp("job") for key in ("whole", *MOMENTS)}
    procs = {
        key: launch(tmp, "run", *((key[0], str(key[1]), "1") if key != "whole" else ())) for key, tmp in tmps.items()
    }
    return {key: (*finish(proc, tmps[key], "run"), tmps[key] / "run") for key, proc in procs.items()}


@pytest.fixture(scope="module")
def uninterrupted(jobs: dict) -> list[dict]:
    code, text, rows, _ = jobs["whole"]
    assert code == 0, text
    return rows


@pytest.mark.timeout(300)
@pytest.mark.parametrize("moment,step", MOMENTS)
def test_a_worker_killed_at_any_moment_comes_back_and_finishes_the_same_curve(
    moment: str, step: int, uninterrupted: list[dict], jobs: dict
) -> None:
    code, text, rows, run = jobs[moment, step]
    assert code == 0, text
    assert "failed (exitcode" in text  # a worker of the first attempt failed
    assert "--resume: resuming from" in text and "at step 4" in text, text  # the save at 8 (or 6) was not complete
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in uninterrupted]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events] == [("resumed", 4)]
    assert "torchrun restarted the workers (attempt 1)" in events[0]["cause"]


@pytest.mark.timeout(300)
def test_a_job_that_fails_alike_on_every_attempt_says_why_each_time(jobs: dict, tmp_path: Path) -> None:
    """A damaged checkpoint under --resume fails every attempt the same way: the sentence
    once per attempt, a non-zero exit, no hang."""
    code, text, _, whole = jobs["whole"]
    assert code == 0, text
    shutil.copytree(whole, tmp_path / "run")
    shard = sorted((tmp_path / "run" / "ckpt" / f"step_{STEPS:08d}").glob("*.distcp"))[0]
    shard.write_bytes(b"\0" * shard.stat().st_size)
    code, text, _ = torchrun(tmp_path, "run")
    assert code != 0
    assert text.count(f"{shard.name} is damaged") == 2, text  # attempt 0, then the one restart


@pytest.mark.timeout(300)
def test_a_worker_whose_peers_never_join_ends_within_the_timeout_with_a_sentence(tmp_path: Path) -> None:
    """Under torchrun's agent store, rank 0 of 2 whose peer never comes ends after
    --comm-timeout with the sentence and a non-zero exit, instead of waiting in the rendezvous."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the torchrun agent's store
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    env |= {"MASTER_PORT": str(agent.port), "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1"}
    job = [*JOB, "--comm-timeout", "5", "--out", str(tmp_path / "run"), "--resume", str(tmp_path / "ckpt")]
    cmd = [sys.executable, "-m", "experiments.train", *job, "--data-cache", str(tmp_path / "cache")]
    start = time.monotonic()
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=allow(100))
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stdout + done.stderr
    assert "rank 0 of 2 could not join its process group (torchrun attempt 1) within 5 s" in done.stderr, done.stderr
    assert "raise --comm-timeout" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert elapsed < allow(60), f"took {elapsed:.0f} s"
