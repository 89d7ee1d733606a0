"""What the test files share: the flags of the smallest training run (`TINY_RUN`, a 2-layer
GPT of width 32 on 32-token sequences, global batch 4, no wandb, quiet console), and the
markers (pyproject.toml): `slow` for tests over about ten seconds, `bench` for the
benchmarks' smoke runs. A test appends its own flags; the last of a repeated flag wins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

TINY_RUN = [
    *("--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--max-seq-len", "32", "--seq-len", "32"),
    *("--global-batch-size", "4", "--wandb", "disabled", "--log-every", "1000"),
]


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
