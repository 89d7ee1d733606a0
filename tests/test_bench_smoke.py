"""Smoke test of `python -m experiments.bench.zero_vs_torch --quick` on 2 gloo ranks.

Runs the real command in a subprocess (it launches its own rank processes) and checks
that every method and every ratio is in the printed table and the JSON, with finite
numbers, and that all methods trained the same thing (fp32 losses agree). It is part of
the default suite; its timeout keeps a slow or stuck run from holding the suite. `-m "not
bench"` skips it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from experiments.bench.zero_vs_torch import PAIRINGS, TORCH_METHODS
from tests.conftest import run_bench
from tests.timing import allow

pytestmark = pytest.mark.bench


@pytest.mark.timeout(150)
def test_zero_vs_torch_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    start = time.monotonic()
    proc = run_bench("zero_vs_torch", "--quick", "--world-sizes", "2", "--json", str(out), timeout=140)
    elapsed = time.monotonic() - start

    text = proc.stdout
    pairings = [(a, b, g) for a, b, g in PAIRINGS if b in TORCH_METHODS]  # the default run: no DeepSpeed
    for method in TORCH_METHODS:
        assert f"| {method} " in text, f"{method} missing from the table:\n{text}"
    for ours, theirs, _ in pairings:
        assert f"| {ours} / {theirs} " in text, f"{ours} / {theirs} missing from the ratios:\n{text}"
    assert "bucket_numel=" in text and "unit_numel=" in text  # the options used are stated

    results = json.loads(out.read_text())
    world = results["worlds"]["2"]
    assert set(world["methods"]) == set(TORCH_METHODS)
    for method, entry in world["methods"].items():
        numbers = [
            entry["median_ms"],
            entry["p25_ms"],
            entry["p75_ms"],
            entry["fwd_bwd_median_ms"],
            entry["cpu_median_ms"],
            entry["final_loss"],
            *entry["memory_rank0"].values(),
        ]
        assert all(math.isfinite(x) for x in numbers), (method, entry)
        assert entry["median_ms"] > 0 and entry["memory_rank0"]["params"] > 0, (method, entry)
    assert len(world["ratios"]) == len(pairings)
    for r in world["ratios"]:
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
    # the same model on the same batches: fp32 losses agree across all eight methods
    assert world["loss_spread"] < 1e-4, world["loss_spread"]
    # sharding shows in the measured memory: stage 3 holds less than stage 0
    mem = {m: sum(e["memory_rank0"].values()) for m, e in world["methods"].items()}
    assert mem["zero3"] < mem["zero2"] < mem["zero1"] < mem["zero0"]
    assert abs(mem["zero0"] - mem["ddp"]) < 0.01 * mem["ddp"]  # both replicate everything (step counters differ)
    assert elapsed < allow(120), f"the smoke run took {elapsed:.0f} s"


@pytest.mark.timeout(150)
def test_zero_vs_torch_by_model_size(tmp_path: Path) -> None:
    """--dims: the run once per model size, its results under "dims", and one table of the
    ratios by size."""
    out = tmp_path / "bench.json"
    argv = ["--quick", "--world-sizes", "2", "--dims", "32", "64", "--methods", "zero0", "ddp", "zero1", "ddp_zero"]
    proc = run_bench("zero_vs_torch", *argv, "--json", str(out), timeout=140)
    assert "## ratios by model size" in proc.stdout
    for pairing in ("| zero0 / ddp ", "| zero1 / ddp_zero "):
        assert sum(line.startswith(pairing) for line in proc.stdout.splitlines()) == 3, proc.stdout  # 2 runs + by size
    results = json.loads(out.read_text())
    assert "worlds" not in results and list(results["dims"]) == ["32", "64"]
    numels = [results["dims"][d]["numel"] for d in ("32", "64")]
    assert numels[0] < numels[1]
    for size in results["dims"].values():
        ratios = size["worlds"]["2"]["ratios"]
        assert [(r["ours"], r["theirs"]) for r in ratios] == [("zero0", "ddp"), ("zero1", "ddp_zero")]
        assert all(math.isfinite(r["ratio"]) for r in ratios)
