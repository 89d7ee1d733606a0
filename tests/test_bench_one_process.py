"""Smoke test of `python -m experiments.bench.one_process --quick`: every method's row with
finite numbers, and ZeroOptimizer at every stage training exactly as torch's fused AdamW."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.bench.one_process import METHODS
from tests.conftest import run_bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(120)
def test_one_process_quick(tmp_path: Path) -> None:
    out = tmp_path / "one.json"
    proc = run_bench("one_process", "--quick", "--json", str(out), timeout=110)
    for method in METHODS:
        assert f"| {method} " in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == list(METHODS)
    for r in rows:
        assert all(math.isfinite(x) and x > 0 for x in (r["median_ms"], r["ratio"])), r
    assert len({r["loss"] for r in rows}) == 1, rows  # the same training, to the last bit
