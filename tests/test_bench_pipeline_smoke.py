"""Smoke test of `python -m experiments.bench.pipeline_bubble --quick` (pp=4 gloo ranks).

Runs the real command in a subprocess (it launches its own rank processes) and checks that
the table has a row for every (schedule, m) with finite numbers, that the JSON agrees, that
our executor and torch.distributed.pipelining computed the same losses, and that the
measured timeline PNG is written. `-m "not bench"` skips it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from experiments.bench.pipeline_bubble import Config, theory
from tests.conftest import run_bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(120)
def test_pipeline_bubble_quick(tmp_path: Path) -> None:
    out, png = tmp_path / "bubble.json", tmp_path / "timeline.png"
    proc = run_bench("pipeline_bubble", "--quick", "--json", str(out), "--png", str(png), timeout=110)
    text = proc.stdout
    cfg = Config()
    expected = [(name, v, m) for name, v in cfg.schedules() for m in cfg.microbatches()]
    for name, v, m in expected:
        row = re.search(rf"^\| {re.escape(name)} +\| {v} +\| {m} +\|(.*)\|$", text, re.MULTILINE)
        assert row, f"row {name} m={m} missing from the table:\n{text}"
        cells = [c.strip() for c in row.group(1).split("|")]
        assert len(cells) == 10 and all(math.isfinite(float(c)) for c in cells), (name, m, cells)
    assert "compete for cores" in text  # the oversubscription caveat is stated

    results = json.loads(out.read_text())
    assert [(r["schedule"], r["v"], r["m"]) for r in results["rows"]] == expected
    assert not results["nonfinite"]
    for r in results["rows"]:
        for key in ("idle_measured", "idle_theory", "idle_sim"):
            assert 0.0 <= r[key] < 1.0, (key, r)
        assert r["idle_theory"] == pytest.approx(theory(cfg.pp, r["m"], r["v"]))
        assert r["ours_ms"] > 0 and r["torch_ms"] > 0 and r["ratio"] > 0, r
        assert r["loss_max_abs_diff"] < 1e-5, r  # same weights, same batches, fp32
    assert png.stat().st_size > 0
