"""CPU smoke run of `python -m experiments.bench.gpu_mfu --quick`: both loops train the same
model on the same batches and report finite throughput (MFU needs a GPU peak)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(180)
def test_gpu_mfu_quick_runs_on_cpu(tmp_path: Path) -> None:
    proc = run_bench("gpu_mfu", "--quick", "--steps", "2", "--warmup", "1", "--data-cache", str(tmp_path), timeout=170)
    rows = (line.split() for line in proc.stdout.splitlines() if line.startswith(("ours ", "ours_fp8", "plain")))
    lines = {fields[0]: fields for fields in rows}
    assert set(lines) == {"ours", "plain", "ours_fp8"}
    for name, fields in lines.items():
        assert float(fields[1]) > 0 and float(fields[2]) > 0, (name, fields)
    assert "step time ours / plain:" in proc.stdout and "step time ours / ours_fp8:" in proc.stdout
