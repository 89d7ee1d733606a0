"""CPU smoke run of `python -m experiments.bench.gpu_suite --cpu-smoke`: every part of the
GPU suite runs on a tiny model with CUDA hidden, and both result files are written.

The parts that measure something on a CPU (environment, fused_step, quantize, mfu, memory,
zero_stages, compile) must be ok; `pytest -m cuda` can only skip there (or pass, were a test to run
without CUDA). `-m "not bench"` skips it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.bench.gpu_suite import PARTS

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]
RUN_ON_CPU = ("environment", "fused_step", "quantize", "mfu", "memory", "zero_stages", "compile", "context", "fp8")


@pytest.mark.timeout(300)
def test_gpu_suite_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.bench.gpu_suite",
            "--cpu-smoke",
            "--out",
            str(out),
            "--data-cache",
            str(tmp_path / "tokens"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=290,
        check=False,
    )
    assert proc.returncode == 0, f"suite failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"

    results = json.loads((out / "gpu_suite.json").read_text())
    md = (out / "gpu_suite.md").read_text()
    assert [p.name for p in PARTS] == list(results["parts"]), results["parts"].keys()
    sections = dict(s.split("\n", 1) for s in md.split("\n#### ")[1:])  # part name -> its markdown
    for name, part in results["parts"].items():
        assert part["status"] in ("ok", "failed", "skipped"), (name, part)
        assert f"[gpu_suite] {name}: {part['status']}" in proc.stdout, proc.stdout
        if part["status"] == "ok":  # its table
            assert any(line.startswith("| ") for line in sections[name].splitlines()), sections[name]
    for name in RUN_ON_CPU:
        assert results["parts"][name]["status"] == "ok", (name, results["parts"][name])
    assert results["parts"]["cuda_tests"]["status"] in ("skipped", "ok"), results["parts"]["cuda_tests"]

    env = results["parts"]["environment"]
    assert env["copy_gbs"] > 0 and env["matmul_tflops"] > 0
    fused_rows = results["parts"]["fused_step"]["rows"]
    assert fused_rows[0]["backend"] is None and all(r["gbs"] > 0 and r["of_copy"] > 0 for r in fused_rows)
    quantized = results["parts"]["quantize"]["rows"]
    assert {(r["bits"], r["op"]) for r in quantized} == {(b, op) for b in (8, 4) for op in ("quantize", "dequantize")}
    assert all(r["gbs"] > 0 and r["of_copy"] > 0 for r in quantized)
    loops = {"ours", "plain", "ours_compiled", "plain_compiled", "ours_fp8"}
    assert {r["loop"] for r in results["parts"]["mfu"]["rows"]} == loops
    memory = results["parts"]["memory"]["rows"]
    assert {(r["recompute"], r["seq_len"]) for r in memory} == {
        (c, s) for c in ("none", "selective", "full") for s in (32, 64)
    }
    for r in memory:  # the planner's model states are the tensors ZeroOptimizer holds
        assert r["states_tensors"] == pytest.approx(r["states_predicted"], rel=0.05), r
        assert r["activations_saved"] > 0 and r["activations_cuda"] is None
    compiled = results["parts"]["compile"]
    assert compiled["targets"] == ["sm_90", "gfx942"] and len(compiled["rows"]) == 2 * 2 * 48, compiled["targets"]
    assert all(r["ok"] and r["spills"] == 0 for r in compiled["rows"]) and compiled["narrow_on_cuda"] == 0
    methods = ["plain", "zero0", "zero1", "zero2", "zero3"]
    assert [r["method"] for r in results["parts"]["zero_stages"]["rows"]] == [
        *methods,
        *(m + "_compiled" for m in methods),
    ]
    assert [r["seq"] for r in results["parts"]["context"]["rows"]] == [1024, 2048]
    assert [r["linears"] for r in results["parts"]["fp8"]["rows"]] == ["bf16", "float8 down,proj,qkv,up"]
