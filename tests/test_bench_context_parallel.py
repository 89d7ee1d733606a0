"""Smoke test of `python -m experiments.bench.context_parallel --quick`: the zigzag gives every
ring member the same attention FLOPs while the contiguous ring's last member does 2 − 1/cp
times the mean, activations per rank fall as 1/cp (within the goal), and the timings are
finite."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import run_bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(240)
def test_context_parallel_quick(tmp_path: Path) -> None:
    out = tmp_path / "cp.json"
    run_bench("context_parallel", "--quick", "--json", str(out), timeout=230)
    results = json.loads(out.read_text())
    s = results["config"]["attention_seq"]
    for r in results["balance"]:
        cp, c = r["cp"], s // r["cp"]
        if r["layout"] == "zigzag":
            assert r["flop_ratio"] == 1.0
        else:
            mean = (cp - 1) / 2 * c * c + c * (c + 1) / 2
            assert r["flop_ratio"] == pytest.approx(((cp - 1) * c * c + c * (c + 1) / 2) / mean)
        assert all(math.isfinite(t) and t > 0 for t in r["ms"])
    assert [r["cp"] for r in results["memory"]] == [1, 2, 4]
    assert all(r["goal"]["met"] for r in results["memory"][1:]), results["memory"]
    assert math.isfinite(results["step"]["ratio"]) and results["step"]["flops_ratio"] > 1
