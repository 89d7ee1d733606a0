"""Smoke test of `python -m experiments.bench.moe_layer --quick`: our MoE layer and
transformers' Mixtral block (eager and grouped_mm experts) on the same weights give the same
output, and every method's row has finite timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.bench.moe_layer import PEERS
from tests.conftest import run_bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(120)
def test_moe_layer_quick(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    run_bench("moe_layer", "--quick", "--json", str(out), timeout=110)
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["ours", *PEERS]
    for r in rows:
        assert math.isfinite(r["median_ms"]) and r["median_ms"] > 0 and r["max_diff"] <= 1e-4, r
