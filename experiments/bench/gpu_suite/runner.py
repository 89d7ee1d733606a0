"""Runs the suite's parts: each in a fresh process under its time limit, failing softly;
the result files rewritten after every part."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from experiments.bench.gpu_suite.report import markdown, note
from experiments.bench.results import write_json

ROOT = Path(__file__).resolve().parents[3]
GPU_BUDGET_S = 520.0  # the parts' budgets add up to this; --budget scales them
SMOKE_BUDGET_S = 240.0  # --cpu-smoke's default budget
MIN_PART_S = 5.0  # a part left less than this is skipped
_CTX = mp.get_context("forkserver")


@dataclasses.dataclass(frozen=True)
class Context:
    """What a part is given: the mode, the model config, the training command's token
    cache, its time limit and the results of the parts before it."""

    smoke: bool
    config: str
    data_cache: str | None
    limit_s: float = 0.0
    earlier: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    run: Callable[[Context], dict[str, Any]]
    budget_s: float  # seconds of GPU_BUDGET_S
    table: Callable[[dict[str, Any]], str]  # the markdown of an `ok` result


def _failure(e: BaseException) -> dict[str, Any]:
    """A failed part: the exception in one line, the traceback's tail (also printed to the log)."""
    lines = traceback.format_exc().rstrip().splitlines()
    print("\n".join(lines), file=sys.stderr)
    message = str(e).strip().splitlines()
    return {
        "status": "failed",
        "error": f"{type(e).__name__}: {message[0] if message else ''}",
        "traceback": lines[-15:],
    }


def _child(run: Callable[[Context], dict[str, Any]], ctx: Context, log: str, conn: Connection) -> None:
    """One part in its own process group, output appended to `log`; sends its result."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    print(f"\n===== {run.__name__} (limit {ctx.limit_s:.0f} s) =====", flush=True)
    try:
        result = run(ctx)
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:  # every failure is the part's result
        result = _failure(e)
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(result)


def _kill(proc: mp.process.BaseProcess) -> None:
    """Kill the part's process group (it and the subprocesses it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        proc.kill()


def run_part(part: Part, ctx: Context, log: Path) -> dict[str, Any]:
    """`part.run(ctx)` in a fresh process, killed after ctx.limit_s; its result with the
    wall seconds it took."""
    reader, writer = _CTX.Pipe(duplex=False)
    proc = _CTX.Process(target=_child, args=(part.run, ctx, str(log), writer), name=part.name)
    t0 = time.monotonic()
    proc.start()
    writer.close()
    result = None
    if reader.poll(ctx.limit_s):
        with contextlib.suppress(EOFError):  # it died without a result
            result = reader.recv()
    if result is None and proc.is_alive():
        _kill(proc)
        result = {"status": "failed", "error": f"timed out after {ctx.limit_s:.0f} s (killed)"}
    proc.join(30)
    if proc.is_alive():
        _kill(proc)
        proc.join()
    if result is None:
        result = {"status": "failed", "error": f"the process died (exit code {proc.exitcode}) without a result"}
    reader.close()
    return {**result, "seconds": round(time.monotonic() - t0, 1), "limit_s": round(ctx.limit_s)}


def run_suite(parts: list[Part], ctx: Context, budget_s: float, out: Path, command: str) -> dict[str, Any]:
    """Run the parts in order within `budget_s`, rewriting the result files after each."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_suite.log"
    log.write_text("")
    _CTX.set_forkserver_preload(["torch"])
    results: dict[str, Any] = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "smoke": ctx.smoke,
        "budget_s": budget_s,
        "parts": {},
    }
    start = time.monotonic()
    scale = budget_s / GPU_BUDGET_S
    for i, part in enumerate(parts):
        reserved = scale * sum(p.budget_s for p in parts[i + 1 :])  # what the later parts are promised
        limit = budget_s - (time.monotonic() - start) - reserved
        if limit < MIN_PART_S:
            result = {"status": "skipped", "reason": f"the suite's budget is spent ({limit:.0f} s left for this part)"}
        else:
            result = run_part(part, dataclasses.replace(ctx, limit_s=limit, earlier=dict(results["parts"])), log)
        results["parts"][part.name] = result
        results["seconds"] = round(time.monotonic() - start, 1)
        print(
            f"[gpu_suite] {part.name}: {result['status']} ({result.get('seconds', 0):.1f} s) {note(result)}", flush=True
        )
        write_results(results, parts, out)
    return results


def _commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def write_results(results: dict[str, Any], parts: list[Part], out: Path) -> None:
    write_json(out / "gpu_suite.json", results)
    (out / "gpu_suite.md").write_text(markdown(results, {p.name: p.table for p in parts}))
