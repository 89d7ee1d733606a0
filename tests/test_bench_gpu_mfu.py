"""CPU smoke run of `python -m experiments.bench.gpu_mfu --quick`: every loop (ours and plain,
eager and compiled, and ours compiled with float8) trains the same model on the same batches
and reports finite throughput (MFU needs a GPU peak)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(240)
def test_gpu_mfu_quick_runs_on_cpu(tmp_path: Path) -> None:
    proc = run_bench("gpu_mfu", "--quick", "--steps", "2", "--warmup", "1", "--data-cache", str(tmp_path), timeout=230)
    rows = (line.split() for line in proc.stdout.splitlines() if line.startswith(("ours", "plain")))
    lines = {fields[0]: fields for fields in rows if fields[0] in LOOPS}
    assert set(lines) == LOOPS
    for name, fields in lines.items():
        assert float(fields[1]) > 0 and float(fields[2]) > 0, (name, fields)
    for ratio in ("step time ours / plain:", "step time ours_compiled / plain_compiled:", "tokens/s ours_fp8 / bf16:"):
        assert ratio in proc.stdout, proc.stdout


LOOPS = {"ours", "plain", "ours_compiled", "plain_compiled", "ours_fp8"}
