"""What the test files share: the flags of the smallest training run (`TINY_RUN`, a 2-layer
GPT of width 32 on 32-token sequences, global batch 4, no wandb, quiet console), and the
markers (pyproject.toml): `slow` for tests over about ten seconds, `bench` for the
benchmarks' smoke runs. A test appends its own flags; the last of a repeated flag wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TINY_RUN = [
    *("--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--max-seq-len", "32", "--seq-len", "32"),
    *("--global-batch-size", "4", "--wandb", "disabled", "--log-every", "1000"),
]


# The repo's own code uses ZeroOptimizer's policies, never the deprecated flat options: an old
# spelling fails in the test process (pyproject's filterwarnings) and in every rank it spawns.
os.environ["PYTHONWARNINGS"] = ",".join(
    w for w in (os.environ.get("PYTHONWARNINGS"), "error:ZeroOptimizer(:DeprecationWarning") if w
)


def read_run(out: Path) -> tuple[list[float], dict]:
    """(the loss of every step, summary.json) of a training run's folder `out`."""
    with open(out / "metrics.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f]
    with open(out / "summary.json") as f:
        return losses, json.load(f)


def slow_except(quick: list, rest: list) -> list:
    """Parametrize values: `quick` in the quick run, `rest` marked slow (a matrix keeps one
    representative per feature in `-m "not slow"`, every cell in the full suite)."""
    import pytest

    return [*quick, *(pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow) for v in rest)]


def pytest_collection_modifyitems(items: list) -> None:
    """A benchmark's smoke run is slow too, so `-m "not slow"` leaves it out."""
    import pytest

    for item in items:
        if item.get_closest_marker("bench") is not None:
            item.add_marker(pytest.mark.slow)


def run_bench(module: str, *args: str, timeout: float, env: dict[str, str] | None = None) -> Any:
    """`python -m experiments.bench.<module> *args` from the repository root, which must exit 0;
    the finished process (its stdout and stderr as text)."""
    proc = subprocess.run(
        [sys.executable, "-m", f"experiments.bench.{module}", *args],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, f"benchmark failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc
