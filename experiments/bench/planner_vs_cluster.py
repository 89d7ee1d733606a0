"""The planner against measured runs on the emulated cluster (experiments.cluster: hosts as
network namespaces, links shaped by tc; root needed).

    python -m experiments.bench.planner_vs_cluster                    # the table in docs/planner.md
    python -m experiments.bench.planner_vs_cluster --quick            # 2 layouts, 1 topology, 1 link
    python -m experiments.bench.planner_vs_cluster --keep DIR         # keep hardware files and runs

For each topology (hosts × processes per host) and link rate, `experiments.calibrate` first
measures the hardware file of that cluster (matmul rate, the model's share of it, copy and
collective bandwidths and latencies); then each layout trains --steps steps of
experiments/configs/cluster.yaml through the training command, and its median step time
(after --warmup steps) stands next to the planner's prediction for the same run
(`costmodel.run_spec` of the run's own config, `experiments.plan.predict_one` on the
calibrated cluster). The layouts: ZeRO-3 over dp 4; hybrid, the shard group inside a host;
ZeRO++ (qwZ int8, hpZ, int4 qgZ); ZeRO-1; tp 2 × dp 2 (tp inside a host on 2 × 2, across
hosts on 4 × 1); pp 2 × dp 2 (the stages on different hosts).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from experiments.bench import tables
from experiments.bench.common import median
from experiments.bench.config import Bench, parse_config
from experiments.bench.results import write_json
from experiments.plan import predict_one
from research import costmodel
from research.cli import arg
from research.costmodel.hardware import load_system

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "experiments/configs/cluster.yaml"
LAYOUTS: dict[str, list[str]] = {
    "zero3": ["--dp", "4", "--zero", "3"],
    "hybrid": ["--dp", "4", "--dp-shard", "2", "--zero", "3"],
    "zero++": ["--dp", "4", "--zero", "3", "--qwz-block", "2048", "--hpz", "--qgz-bits", "4"],
    "zero1": ["--dp", "4", "--zero", "1"],
    "tp2": ["--tp", "2", "--dp", "2", "--zero", "1"],
    "pp2": ["--pp", "2", "--dp", "2", "--zero", "1"],
}
ONE_HOST_ONLY = {"hybrid": "its shard group would cross hosts", "zero++": "hpZ needs several processes a host"}
COLUMNS: dict[str, tables.Cell] = {
    "cluster": "topology",
    "link": "link",
    "layout": "layout",
    "measured s": lambda r: format(r["measured_s"], ".3f") if "measured_s" in r else "failed",
    "predicted s": "predicted_s:.3f",
    "predicted / measured": "ratio:.2f",
}


@dataclass
class Config(Bench):
    topologies: tuple[str, ...] = arg(("2x2", "4x1"), "clusters, HOSTSxPROCS (hosts x processes per host)")
    links: tuple[str, ...] = arg(("100mbit", "1gbit"), "link rates between hosts (tc)")
    layouts: tuple[str, ...] = arg(tuple(LAYOUTS), "layouts to train", choices=tuple(LAYOUTS))
    steps: int = arg(12, "training steps per run")
    warmup: int = arg(3, "steps before the median step time")
    keep: str | None = arg(None, "write the hardware files and runs here (None: a temporary folder)", metavar="DIR")

    QUICK: ClassVar[dict[str, Any]] = {
        "topologies": ("2x2",), "links": ("1gbit",), "layouts": ("zero3", "zero1"), "steps": 5, "warmup": 2
    }  # fmt: skip


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def calibrate(hosts: int, per_host: int, link: str, out: Path) -> None:
    done = _run(
        [sys.executable, "-m", "experiments.calibrate", "--hosts", str(hosts), "--procs-per-host", str(per_host),
         "--link", link, "--config", CONFIG, "--out", str(out)],
        600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"calibration failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def train(hosts: int, per_host: int, link: str, flags: list[str], steps: int, out: Path) -> dict[str, Any]:
    """The run's summary.json and per-step times (metrics.jsonl), or {"error": ...}."""
    cluster = [sys.executable, "-m", "experiments.cluster", "--hosts", str(hosts), "--procs-per-host", str(per_host)]
    command = [
        *cluster, "--link", link, "--timeout", "900", "--", "-m", "experiments.train", "--config", CONFIG, *flags,
        "--steps", str(steps), "--seed", "0", "--wandb", "disabled", "--log-every", "1",
        "--out", str(out), "--data-cache", str(out.parent / "cache"),
    ]  # fmt: skip
    done = _run(command, 1000)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-2000:]}
    with open(out / "metrics.jsonl") as f:
        times = [json.loads(line)["step_time_s"] for line in f]
    return {"summary": json.loads((out / "summary.json").read_text()), "times": times}


def compare(
    hosts: int, per_host: int, link: str, layouts: list[str], steps: int, warmup: int, work: Path
) -> list[dict]:
    """One row per layout: measured median step time and the calibrated planner's."""
    hardware = work / f"{hosts}x{per_host}-{link}.yaml"
    calibrate(hosts, per_host, link, hardware)
    system = load_system(hardware)
    rows = []
    for name in layouts:
        if per_host == 1 and name in ONE_HOST_ONLY:
            continue
        run = train(hosts, per_host, link, LAYOUTS[name], steps, work / f"{hosts}x{per_host}-{link}-{name}")
        row: dict[str, Any] = {"topology": f"{hosts} × {per_host}", "link": link, "layout": name}
        if "error" in run:
            rows.append({**row, "error": run["error"]})
            continue
        model, layout, seq_len = costmodel.run_spec(run["summary"]["config"])
        predicted = predict_one(model, layout, seq_len, system.cluster(hosts * per_host))
        measured = median(run["times"][warmup:])
        rows.append({**row, "measured_s": measured, "predicted_s": predicted["step_s"],
                     "ratio": predicted["step_s"] / measured, "error": predicted["error"]})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    return tables.table(rows, COLUMNS)


def fastest(rows: list[dict]) -> list[str]:
    """Per (topology, link): the measured fastest layout and the planner's."""
    out = []
    for key in dict.fromkeys((r["topology"], r["link"]) for r in rows if "measured_s" in r):
        mine = [r for r in rows if (r["topology"], r["link"]) == key and "measured_s" in r]
        measured = min(mine, key=lambda r: r["measured_s"])["layout"]
        predicted = min(mine, key=lambda r: r["predicted_s"])["layout"]
        out.append(f"{key[0]} at {key[1]}: fastest measured {measured}, predicted {predicted}")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    """Every topology and link: calibrate, train the layouts, print the table so far; then the
    fastest layouts; the rows as --json writes them."""
    cfg, args = parse_config(Config, __doc__, argv)
    rows = []
    with contextlib.ExitStack() as stack:
        work = Path(cfg.keep) if cfg.keep else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pvc-")))
        work.mkdir(parents=True, exist_ok=True)
        for topology in cfg.topologies:
            hosts, per_host = map(int, topology.split("x"))
            for link in cfg.links:
                rows += compare(hosts, per_host, link, list(cfg.layouts), cfg.steps, cfg.warmup, work)
                print(table(rows), flush=True)
    print("\n".join(fastest(rows)))
    if args.json:
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
