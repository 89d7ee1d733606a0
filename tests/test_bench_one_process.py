"""Smoke test of `python -m experiments.bench.one_process --quick`: every method's row with
finite numbers, and ZeroOptimizer at every stage training exactly as torch's fused AdamW."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.bench.one_process import METHODS

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_one_process_quick(tmp_path: Path) -> None:
    out = tmp_path / "one.json"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.one_process", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, f"benchmark failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    for method in METHODS:
        assert f"| {method} " in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == list(METHODS)
    for r in rows:
        assert all(math.isfinite(x) and x > 0 for x in (r["median_ms"], r["ratio"])), r
    assert len({r["loss"] for r in rows}) == 1, rows  # the same training, to the last bit
