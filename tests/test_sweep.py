"""experiments.sweep: grid expansion and point names, sweep-file validation, failure
reasons, tables and plots from point folders, and a real sweep of three 2-process points
(one fine, one with an invalid flag, one that times out) that is then resumed.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import yaml

from experiments import sweep as sw
from experiments import sweep_results
from experiments.sweep_plots import pareto_front

pytestmark = pytest.mark.slow

TINY = str(Path(__file__).resolve().parent.parent / "experiments" / "configs" / "tiny.yaml")


def write_sweep(folder: Path, **spec) -> Path:
    path = folder / f"{spec.get('name', 'test')}.yaml"
    path.write_text(yaml.safe_dump({"base": TINY, **spec}, sort_keys=False))
    return path


# ---------------------------------------------------------------------------
# The sweep file
# ---------------------------------------------------------------------------


def test_grid_is_a_cartesian_product_in_key_order_and_points_cross_it() -> None:
    grid = sw.expand({"grid": {"dp": [2, 4], "zero": [0, 1]}})
    assert grid == [{"dp": 2, "zero": 0}, {"dp": 2, "zero": 1}, {"dp": 4, "zero": 0}, {"dp": 4, "zero": 1}]
    assert [sw.point_name(p) for p in grid] == ["dp-2_zero-0", "dp-2_zero-1", "dp-4_zero-0", "dp-4_zero-1"]
    crossed = sw.expand(
        {
            "points": [{"schedule": "1f1b"}, {"schedule": "interleaved-1f1b", "virtual_stages": 2}],
            "grid": {"micro_batches": [4, 8]},
        }
    )
    assert [sw.point_name(p) for p in crossed] == [
        "schedule-1f1b_micro-batches-4",
        "schedule-1f1b_micro-batches-8",
        "schedule-interleaved-1f1b_virtual-stages-2_micro-batches-4",
        "schedule-interleaved-1f1b_virtual-stages-2_micro-batches-8",
    ]
    assert sw.expand({"points": [{"tp": 2}, {"pp": 2}]}) == [{"tp": 2}, {"pp": 2}]
    assert sw.expand({}) == [{}]


def test_point_names_are_stable_and_filesystem_safe() -> None:
    assert sw.point_name({}) == "base"
    name = sw.point_name({"sequence_parallel": True, "lr": 0.003, "dp": None})
    assert name == "sequence-parallel-true_lr-0.003_dp-none"
    assert sw.point_name({"data": "corpus/a b.txt", "timeout": 5}) == "data-corpus-a-b.txt"  # timeout is not a setting
    assert sw.point_name({"name": "my run/1", "tp": 2}) == "my-run-1"
    long = {f"key_{i}": "value" * 5 for i in range(10)}
    assert len(sw.point_name(long)) <= 100 and sw.point_name(long) == sw.point_name(dict(long))
    assert sw.flags({"sequence_parallel": False, "dp": None, "zero": 1, "lr": 0.003}) == [
        "--no-sequence-parallel",
        "--dp",
        "none",
        "--zero",
        "1",
        "--lr",
        "0.003",
    ]


def test_load_sweep_builds_one_torchrun_command_per_point(tmp_path: Path) -> None:
    path = write_sweep(
        tmp_path,
        name="s",
        nproc=2,
        timeout=100,
        common={"steps": 2, "wandb": "disabled"},
        points=[{"tp": 2}, {"name": "wide", "dp": 4}, {"pp": 2, "dp": 2, "timeout": 7}],
    )
    settings, points = sw.load_sweep(path, out=str(tmp_path / "out"))
    assert settings["wandb"] == "disabled" and settings["group"] == "s"
    assert [p.name for p in points] == ["tp-2", "wide", "pp-2_dp-2"]
    assert [p.nproc for p in points] == [2, 4, 4]  # sweep nproc; dp 4; pp·dp
    assert [p.timeout for p in points] == [100, 100, 7]
    assert [p.requested["dp"] for p in points] == [1, 4, 2]
    cmd = points[1].command
    assert cmd[1:4] == ["-m", "experiments.train", "--nproc-per-node=4"]
    assert cmd[cmd.index("--out") + 1 : cmd.index("--out") + 3] == [str(tmp_path / "out" / "wide"), "--overwrite"]
    assert cmd[cmd.index("--steps") : cmd.index("--steps") + 4] == ["--steps", "2", "--dp", "4"]
    assert cmd[-6:] == ["--wandb", "disabled", "--wandb-group", "s", "--wandb-name", "wide"]
    _, points = sw.load_sweep(path, timeout=3, wandb="offline")
    assert [p.timeout for p in points] == [3, 3, 7]  # --timeout beats the file, a point's own beats both
    assert points[0].command[-6:-4] == ["--wandb", "offline"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"grid": {"zeros": [1, 2]}, "nproc": 2}, "'zeros' is not a config field"),
        ({"points": [{"tp": 2}], "nproc": 2, "grids": {}}, "unknown key"),
        ({"points": [{"tp": 2}, {"tp": 2}], "nproc": 2}, "two points are both named 'tp-2'"),
        ({"points": [{"tp": 2}]}, "give nproc"),
        ({"common": {"out": "x"}, "nproc": 2}, "out is set by the sweep"),
        ({"grid": {"zero": 1}, "nproc": 2}, "non-empty list"),
        ({"base": "nowhere.yaml", "nproc": 2}, "nowhere.yaml does not exist"),
    ],
)
def test_load_sweep_rejects_bad_files(tmp_path: Path, spec: dict, message: str) -> None:
    with pytest.raises(sw.SweepError, match=message):
        sw.load_sweep(write_sweep(tmp_path, **spec))


def test_load_sweep_names_a_bad_base_config(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("model:\n  n_layer: 2\n")
    with pytest.raises(sw.SweepError, match=r"base: .*model\.n_layer is not a config key"):
        sw.load_sweep(write_sweep(tmp_path, base=str(tmp_path / "base.yaml"), nproc=1))
    assert sw.main(["--report", str(tmp_path)]) == 2  # no sweep.json there


INVALID = "error: --tp=3 × --pp=1 = 3 does not divide the world size 2\n"
ROOT_CAUSE = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  exitcode  : {code} (pid: 1)
"""


def test_failure_reasons() -> None:
    r = sw.failure_reason(1, INVALID * 2 + ROOT_CAUSE.format(code=2), False, None)
    assert r == {
        "exit_code": 2,
        "kind": "error",
        "reason": "exit 2: error: --tp=3 × --pp=1 = 3 does not divide the world size 2",
    }
    r = sw.failure_reason(1, "Traceback ...\n[rank0]: ValueError: bad\n" + ROOT_CAUSE.format(code=-9), False, None)
    assert r["kind"] == "oom" and r["reason"] == "killed by signal 9 (SIGKILL, out of memory?): ValueError: bad"
    r = sw.failure_reason(1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB", False, None)
    assert r["kind"] == "oom" and r["reason"].startswith("exit 1: torch.OutOfMemoryError: CUDA out of memory")
    assert sw.failure_reason(-15, "", True, 4.0) == {
        "exit_code": -15,
        "kind": "timeout",
        "reason": "timeout: stopped after 4 s",
    }


# ---------------------------------------------------------------------------
# Tables and plots (synthetic point folders)
# ---------------------------------------------------------------------------


def fake_summary(dp: int, zero: int, schedule: str = "1f1b", m: int = 1, tok: float = 1000.0) -> dict:
    psi = 100_000
    memory = {
        "params": 4 * psi // (dp if zero == 3 else 1),
        "grads": 4 * psi // (dp if zero >= 2 else 1),
        "master_and_optimizer": 8 * psi // (dp if zero >= 1 else 1),
        "activations": 300_000,
    }
    comm = {"dp": {"total": {"bytes": 8 * psi}}, "tp": {"total": {"bytes": 0}}, "pp": {"total": {"bytes": 0}}}
    grads_peak = memory["grads"] + 4 * psi // 2
    return {
        "final_loss": 4.5,
        "median_tokens_per_s": tok,
        "median_tflops_per_device": 0.001,
        "median_mfu": None,
        "mem_peak_bytes": 4 << 28,
        "wall_time_s": 3.0,
        "config": _config(
            parallel={"dp": dp, "zero": zero, "schedule": schedule},
            train={"micro_batches": m, "micro_batch_size": 1, "precision": "fp32"},
        ),
        "ranks": [
            {
                "memory_bytes": memory,
                "grads_peak_bytes": grads_peak,
                "peak_bytes": sum(memory.values()) - memory["grads"] + grads_peak,
                "comm_per_step": comm,
                "coords": {"pp": 0, "dp": d, "tp": 0},
            }
            for d in range(dp)
        ],
    }


def _config(**sections: dict) -> dict:
    """A full run config (the defaults) with some fields set, as summary.json holds it."""
    from research.config import RunConfig

    cfg = RunConfig().to_dict()
    for section, values in sections.items():
        cfg[section].update(values)
    return cfg


def fake_sweep(out: Path, summaries: dict[str, dict | None], swept: tuple[str, ...] = ("dp", "zero")) -> None:
    out.mkdir(parents=True)
    points = []
    for name, summary in summaries.items():
        (out / name).mkdir()
        if summary is None:
            (out / name / "failed.json").write_text(json.dumps({"reason": "exit 2: error: no"}))
        else:
            (out / name / "summary.json").write_text(json.dumps(summary))
        cfg = summary["config"] if summary else {"parallel": {}, "train": {}}
        overrides = {k: {**cfg["parallel"], **cfg["train"]}.get(k) for k in swept}
        points.append({"name": name, "overrides": overrides, "requested": {"nproc": 2, "zero": 9}})
    meta = {"name": "fake", "base": TINY, "project": "zero3d", "group": "fake", "points": points}
    (out / "sweep.json").write_text(json.dumps(meta))


def test_pareto_front() -> None:
    # (memory, throughput): (3, 5) is beaten by (2, 6); (2, 6) and (1, 1) and (4, 9) are not
    assert pareto_front([(3, 5), (2, 6), (1, 1), (4, 9), (4, 8)]) == [2, 1, 3]
    # throughputs within their spread are equal: then the memory decides
    noisy = [(1, 100), (2, 104), (3, 130)]
    assert pareto_front(noisy) == [0, 1, 2]
    assert pareto_front(noisy, [0.05, 0.05, 0.05]) == [0, 2]  # 104 is 100 within 5 %; 130 is not
    assert pareto_front(noisy, [0.05, 0.05, 0.4]) == [0]  # 130 is within its own 40 %


def test_report_writes_csv_markdown_and_all_plots(tmp_path: Path) -> None:
    summaries = {f"dp-{dp}_zero-{z}": fake_summary(dp, z, tok=1000 + 100 * z) for dp in (2, 4) for z in range(4)}
    summaries.update({f"{s}-m{m}": fake_summary(2, 1, s, m, 500 * m**0.5) for s in ("1f1b", "zb-h1") for m in (2, 4)})
    summaries["bad"] = None
    fake_sweep(tmp_path / "s", summaries, swept=("dp", "zero", "schedule", "micro_batches"))
    logs: list[str] = []
    rows = sw.report(tmp_path / "s", log=logs.append)
    with open(tmp_path / "s" / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["name"] for r in table] == list(summaries) and tuple(table[0]) == sweep_results.COLUMNS
    row = rows[3]  # dp 2, ZeRO 3: everything but activations sharded
    assert (row["zero"], row["mem_params_bytes"], row["mem_master_and_optimizer_bytes"]) == (3, 200_000, 400_000)
    # params + the gradient peak (shards + the full buckets of backward) + master and optimizer + activations
    assert (
        row["mem_per_rank_bytes"] == 200_000 + (200_000 + 200_000) + 400_000 + 300_000
        and row["comm_dp_bytes"] == 800_000
    )
    assert rows[-1]["status"] == "failed" and rows[-1]["error"] == "exit 2: error: no" and rows[-1]["zero"] == 9
    md = (tmp_path / "s" / "results.md").read_text()
    assert "| name | status | nproc | dp | zero | schedule | micro_batches |" in md
    assert "- `bad`: exit 2: error: no" in md
    for png in ("memory_vs_throughput.png", "memory_breakdown.png", "throughput_vs_micro_batches.png"):
        assert (tmp_path / "s" / png).read_bytes()[:4] == b"\x89PNG", png
    fake_sweep(tmp_path / "one", {"only": fake_summary(2, 1)})
    logs.clear()
    sw.report(tmp_path / "one", log=logs.append)
    assert (tmp_path / "one" / "memory_breakdown.png").exists()
    assert not (tmp_path / "one" / "memory_vs_throughput.png").exists()
    assert any("skipped throughput_vs_micro_batches.png" in line for line in logs)


# ---------------------------------------------------------------------------
# A real sweep: 3 points of 2 processes (fine / invalid flag / timeout), then resumed
# ---------------------------------------------------------------------------

SMALL = {
    "steps": 2,
    "n_layers": 2,
    "n_heads": 2,
    "d_model": 32,
    "max_seq_len": 32,
    "seq_len": 32,
    "global_batch_size": 4,
    "log_every": 1,
}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("sweep")
    path = write_sweep(
        base,
        name="real",
        nproc=2,
        common={**SMALL, "data_cache": str(base / "cache")},
        points=[{"zero": 3}, {"tp": 3}, {"name": "hang", "steps": 100000, "timeout": 4}],
    )
    settings, points = sw.load_sweep(path, out=str(base / "out"), wandb="offline")
    logs: list[str] = []
    first = sw.run_sweep(settings, points, log=logs.append)
    return path, base / "out", first, logs


def _attempts(folder: Path) -> int:
    return json.loads((folder / "point.json").read_text())["attempts"]


def test_sweep_records_failures_and_goes_on(real) -> None:
    _, out, first, logs = real
    assert first["launched"] == ["zero-3", "tp-3", "hang"] and first["failed"] == ["tp-3", "hang"]
    assert (out / "zero-3" / "summary.json").exists() and not (out / "zero-3" / "failed.json").exists()
    invalid = json.loads((out / "tp-3" / "failed.json").read_text())
    assert invalid["reason"] == "exit 2: error: --tp=3 × --pp=1 = 3 does not divide the world size 2", invalid
    assert invalid["exit_code"] == 2 and invalid["returncode"] != 0 and invalid["log_tail"]
    hang = json.loads((out / "hang" / "failed.json").read_text())
    assert hang["kind"] == "timeout" and hang["reason"] == "timeout: stopped after 4 s", hang
    assert "--nproc-per-node=2" in (out / "hang" / "train.log").read_text().splitlines()[0]
    assert not _running_under(out / "hang"), "the timed-out job left processes behind"
    assert any("tp-3 FAILED" in line for line in logs)


def _running_under(folder: Path) -> list[int]:
    """pids of processes whose command line names `folder`."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if str(folder) in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_sweep_writes_results_plots_and_wandb_runs(real) -> None:
    _, out, _, _ = real
    with open(out / "results.csv") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    ok = rows["zero-3"]
    assert (ok["status"], ok["nproc"], ok["dp"], ok["zero"]) == ("ok", "2", "2", "3")
    assert float(ok["tokens_per_s"]) > 0 and float(ok["final_loss"]) > 0 and float(ok["final_loss_mean"]) > 0
    summary = json.loads((out / "zero-3" / "summary.json").read_text())
    assert int(ok["mem_per_rank_bytes"]) == max(r["peak_bytes"] for r in summary["ranks"])  # the true peak
    parts = ("params", "grads_peak", "master_and_optimizer", "activations")
    assert int(ok["mem_per_rank_bytes"]) == sum(int(ok[f"mem_{p}_bytes"]) for p in parts)  # its breakdown beside it
    for key in (
        "mem_params_bytes",
        "mem_grads_bytes",
        "mem_master_and_optimizer_bytes",
        "mem_activations_bytes",
        "mem_peak_bytes",
        "comm_dp_bytes",
    ):
        assert float(ok[key]) > 0, key
    assert float(ok["model_states_predicted_error"]) < 0.05, "the planner's model states, every rank"
    assert rows["tp-3"]["status"] == "failed" and rows["tp-3"]["error"].startswith("exit 2: error: --tp=3")
    assert rows["tp-3"]["tp"] == "3" and rows["hang"]["error"].startswith("timeout")
    md = (out / "results.md").read_text()
    assert "| zero-3 | ok |" in md and "- `hang`: timeout" in md
    assert (out / "memory_breakdown.png").read_bytes()[:4] == b"\x89PNG"
    assert list((out / "zero-3" / "wandb").glob("offline-run-*")), "the point's wandb run"
    assert list((out / "wandb").glob("offline-run-*/files/media/table/results_*.table.json")), "the report run"


def test_rerun_runs_only_what_is_missing_and_report_rebuilds(real) -> None:
    path, out, _, _ = real
    summary_mtime = (out / "zero-3" / "summary.json").stat().st_mtime_ns
    # the CLI, without wandb: the finished point stays, the two failed ones run again
    assert sw.main([str(path), "--out", str(out), "--wandb", "disabled"]) == 1
    assert (out / "zero-3" / "summary.json").stat().st_mtime_ns == summary_mtime
    assert [_attempts(out / n) for n in ("zero-3", "tp-3", "hang")] == [1, 2, 2]
    assert json.loads((out / "tp-3" / "failed.json").read_text())["exit_code"] == 2
    settings, points = sw.load_sweep(path, out=str(out), wandb="disabled")
    assert sw.run_sweep(settings, points, retry_failed=False, log=lambda _: None)["launched"] == []
    for name in ("results.csv", "results.md", "memory_breakdown.png"):
        os.remove(out / name)
    assert sw.main(["--report", str(out)]) == 1  # not every point is ok
    assert all((out / n).exists() for n in ("results.csv", "results.md", "memory_breakdown.png"))


def test_dry_run_prints_commands_and_states(real, capsys) -> None:
    path, out, _, _ = real
    assert sw.main([str(path), "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "3 points, 1 done, 2 to run" in printed
    assert "[ok] " in printed and printed.count("[run] ") == 2 and "--nproc-per-node=2" in printed
    assert "(will fail: error: --tp=3 × --pp=1 = 3 does not divide the world size 2)" in printed
