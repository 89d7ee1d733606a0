"""CPU smoke run of `python -m experiments.bench.fused_step_bandwidth` on a small shard: every
CPU backend and torch's AdamW(fused=True) are timed, with finite bandwidths."""

from __future__ import annotations

import math

import pytest

from tests.conftest import run_bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(120)
def test_fused_step_bandwidth_smoke_on_cpu() -> None:
    proc = run_bench("fused_step_bandwidth", "--numel", "2e5", timeout=110)
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("torch.optim.AdamW", "zero3d"))]
    assert rows[0].startswith("torch.optim.AdamW(fused=True)") and len(rows) >= 3
    for row in rows:
        gbs = float(row.split()[-3])
        assert math.isfinite(gbs) and gbs > 0, row
