"""Smoke test of `python -m experiments.bench.moe_step --quick`: the dense GPT and the MoE GPT
at ep 1, 2, 4 on 4 ranks, every row finite, the MoE runs the same training at every ep, and
all-to-all bytes only where experts are split, equal to the planner's formula with a capacity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.bench.moe_step import METHODS
from tests.conftest import run_bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(300)
def test_moe_step_quick(tmp_path: Path) -> None:
    out = tmp_path / "moe_step.json"
    run_bench("moe_step", "--quick", "--json", str(out), timeout=280)
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(METHODS)
    assert all(math.isfinite(r["median_ms"]) and r["median_ms"] > 0 for r in rows.values())
    assert rows["moe_ep2"]["loss"] == pytest.approx(rows["moe_ep1"]["loss"], rel=1e-5)
    assert rows["moe_ep4"]["loss"] == pytest.approx(rows["moe_ep1"]["loss"], rel=1e-5)
    assert rows["dense"]["a2a_bytes"] == rows["moe_ep1"]["a2a_bytes"] == 0 < rows["moe_ep2"]["a2a_bytes"]
    assert rows["moe_ep2"]["a2a_bytes"] < rows["moe_ep4"]["a2a_bytes"]
    assert rows["moe_ep4_capacity"]["a2a_bytes"] == rows["moe_ep4_capacity"]["formula_bytes"] > 0
