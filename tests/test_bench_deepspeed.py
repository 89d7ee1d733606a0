"""DeepSpeed as a peer in `experiments.bench.zero_vs_torch` (2 gloo ranks, `--quick`): its
ZeRO-1/2/3 engine runs on the CPU accelerator with torch's AdamW, the ratios zeroS / dsS are
reported, and every step's loss of ZeroOptimizer stage S equals DeepSpeed's on the same model
and batches. Skipped without deepspeed (an optional peer); `-m "not bench"` skips it too."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.conftest import run_bench

pytestmark = pytest.mark.bench

pytest.importorskip("deepspeed")
METHODS = ["zero1", "zero2", "zero3", "ds1", "ds2", "ds3"]


@pytest.mark.timeout(300)
def test_deepspeed_peer_trains_the_same(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["--quick", "--world-sizes", "2", "--methods", *METHODS, "--json", str(out)]
    run_bench("zero_vs_torch", *argv, timeout=280, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    world = json.loads(out.read_text())["worlds"]["2"]
    ratios = {(r["ours"], r["theirs"]): r["ratio"] for r in world["ratios"]}
    assert set(ratios) == {("zero1", "ds1"), ("zero2", "ds2"), ("zero3", "ds3")}, ratios
    assert all(math.isfinite(x) and x > 0 for x in ratios.values()), ratios
    for stage in (1, 2, 3):
        ours, theirs = world["methods"][f"zero{stage}"]["losses"], world["methods"][f"ds{stage}"]["losses"]
        assert len(ours) == len(theirs) > 1
        worst = max(abs(a - b) for a, b in zip(ours, theirs))
        assert worst <= 1e-6, f"stage {stage}: losses differ by {worst}: {ours} vs {theirs}"
