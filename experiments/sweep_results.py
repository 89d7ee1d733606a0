"""The results of a sweep: one row per point from its run folder, results.csv, results.md,
the plots (`experiments.sweep_plots`) and a wandb report run."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.sweep_columns import COLUMNS, COMM_GROUPS, CONFIG_COLUMNS
from research import costmodel
from research.metrics import LAST_STEPS

REPO = Path(__file__).resolve().parent.parent

MEMORY_PARTS = ("params", "grads", "master_and_optimizer", "activations")


def status_of(folder: Path) -> str:
    """ "ok" (summary.json exists), "failed" (failed.json) or "missing"."""
    if (folder / "summary.json").exists():
        return "ok"
    return "failed" if (folder / "failed.json").exists() else "missing"


# ---------------------------------------------------------------------------
# Results: rows, CSV, markdown, plots, wandb
# ---------------------------------------------------------------------------


def point_row(summary: dict[str, Any], name: str, status: str) -> dict[str, Any]:
    """One results row from a run's summary.json. Memory: `mem_per_rank_bytes` is the largest
    per-rank `peak_bytes` of the summary (params + the gradient peak + master and optimizer +
    activations, each at its own peak), and the breakdown columns are that rank's: params,
    grads between steps, `mem_grads_peak_bytes` (its shards plus the full buckets of backward),
    master and optimizer, activations, so that params + grads peak + master and optimizer +
    activations = mem/rank; `mem_model_states_bytes` is the largest of the same without
    activations; `mem_peak_bytes` the measured peak (CUDA allocated / CPU RSS). Comm: bytes
    per step per group of the rank that moves the most over tp + pp + dp."""
    cfg = summary["config"]
    ranks = summary["ranks"]
    row: dict[str, Any] = {"name": name, "status": status, "nproc": len(ranks)}
    for section in ("parallel", "train", "model", "data"):
        row.update({k: v for k, v in cfg[section].items() if k in CONFIG_COLUMNS})

    def comm(rank: dict[str, Any], column: str) -> int:
        per_group = rank["comm_per_step"]
        return round(sum(per_group.get(g, {}).get("total", {}).get("bytes", 0) for g in COMM_GROUPS[column]))

    worst = max(ranks, key=lambda r: r["peak_bytes"])
    row["mem_per_rank_bytes"] = worst["peak_bytes"]
    row["mem_model_states_bytes"] = max(r["peak_bytes"] - r["memory_bytes"]["activations"] for r in ranks)
    row.update({f"mem_{k}_bytes": worst["memory_bytes"][k] for k in MEMORY_PARTS})
    row["mem_grads_peak_bytes"] = worst["grads_peak_bytes"]
    busiest = max(ranks, key=lambda r: sum(comm(r, g) for g in COMM_GROUPS))
    row.update({f"comm_{g}_bytes": comm(busiest, g) for g in COMM_GROUPS})
    row["comm_total_bytes"] = sum(round(g["total"]["bytes"]) for g in busiest["comm_per_step"].values())
    row["model_states_predicted_error"] = planner_error(summary)
    row.update(
        tokens_per_s=summary.get("median_tokens_per_s"),
        tokens_per_s_spread=summary.get("tokens_per_s_spread"),
        mfu=summary.get("median_mfu"),
        tflops_per_device=summary.get("median_tflops_per_device"),
        mem_peak_bytes=summary.get("mem_peak_bytes"),
        final_loss=summary.get("final_loss"),
        final_loss_mean=summary.get("final_loss_mean"),
        wall_time_s=summary.get("wall_time_s"),
    )
    return row


def collect(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The sweep's settings (OUT/sweep.json) and one row per point, in sweep order."""
    meta = json.loads((out / "sweep.json").read_text())
    rows = []
    for p in meta["points"]:
        folder, status = out / p["name"], status_of(out / p["name"])
        if status == "ok":
            row = point_row(json.loads((folder / "summary.json").read_text()), p["name"], status)
        else:
            row = {"name": p["name"], "status": status, **p["requested"]}
            if status == "failed":
                row["error"] = json.loads((folder / "failed.json").read_text())["reason"]
        rows.append({c: row.get(c) for c in COLUMNS})
    return meta, rows


def planner_error(summary: dict[str, Any]) -> float:
    """max over ranks of |predicted − measured| / measured model-state bytes, the planner's
    `costmodel.predict_model_states` against the run's own `memory_breakdown`."""
    model, layout, _ = costmodel.run_spec(summary["config"])
    errors = []
    for rank in summary["ranks"]:
        measured = sum(rank["memory_bytes"][k] for k in ("params", "grads", "master_and_optimizer"))
        predicted = costmodel.predict_model_states(model, layout, rank["coords"]["pp"]).total
        errors.append(abs(predicted - measured) / measured)
    return max(errors)


def format_value(column: str, value: Any) -> str:
    """A results cell for people: bytes in KiB/MiB/GiB, MFU, spreads and errors in %, losses
    to 3 decimals, one format per column."""
    if value is None:
        return ""
    if column.endswith("_bytes"):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= size:
                return f"{value / size:.3g} {unit}"
        return f"{value:.0f} B"
    if column in ("mfu", "tokens_per_s_spread"):
        return f"{100 * value:.1f}%"
    if column == "model_states_predicted_error":
        return f"{100 * value:.3f}%"
    if column in ("final_loss", "final_loss_mean"):
        return f"{value:.3f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


MD_HEADERS = {
    "tokens_per_s": "tok/s",
    "tokens_per_s_spread": "tok/s ±",
    "tflops_per_device": "TFLOP/s/dev",
    "mfu": "MFU",
    "mem_per_rank_bytes": "mem/rank",
    "mem_params_bytes": "params",
    "mem_grads_bytes": "grads",
    "mem_master_and_optimizer_bytes": "master+opt",
    "mem_activations_bytes": "activations",
    "mem_grads_peak_bytes": "grads peak",
    "mem_peak_bytes": "peak mem",
    "comm_tp_bytes": "comm tp",
    "comm_pp_bytes": "comm pp",
    "comm_dp_bytes": "comm dp",
    "comm_ep_bytes": "comm ep",
    "comm_cp_bytes": "comm cp",
    "model_states_predicted_error": "planner err",
    "final_loss": "loss",
    "final_loss_mean": f"loss (last {LAST_STEPS})",
}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """results.md: settings shared by every point on one line, then one table row per point
    (config columns that vary, throughput, memory of the largest rank, comm bytes per step,
    final loss), then the failures with their reasons."""
    values = {c: list(dict.fromkeys(str(r[c]) for r in rows if r[c] is not None)) for c in CONFIG_COLUMNS}
    varying = [c for c in CONFIG_COLUMNS if len(values[c]) > 1]
    fixed = [f"{c}={v[0]}" for c, v in values.items() if len(v) == 1]
    columns = ["name", "status", *varying, *MD_HEADERS]
    lines = [f"# Sweep {meta['name']}", ""]
    if meta.get("description"):
        lines += [meta["description"].strip(), ""]
    legend = (
        f"Base `{os.path.relpath(meta['base'], REPO)}`; every point: {', '.join(fixed)}. "
        "mem/rank: the largest rank's peak, params + grads peak + master and optimizer + activations "
        "(its breakdown follows); "
        "peak mem: measured (CUDA allocated, or process RSS on CPU); comm: bytes per step of the busiest "
        "rank; tok/s, TFLOP/s/dev, MFU: medians over the steps."
    )
    lines += [
        legend,
        "",
        "| " + " | ".join(MD_HEADERS.get(c, c) for c in columns) + " |",
        "|" + "|".join("---" if c in ("name", "status", *varying) else "---:" for c in columns) + "|",
    ]
    lines += ["| " + " | ".join(format_value(c, r[c]) for c in columns) + " |" for r in rows]
    failed = [r for r in rows if r["status"] == "failed"]
    if failed:
        lines += ["", "Failed points:", ""] + [f"- `{r['name']}`: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def swept_keys(points: list[dict[str, Any]]) -> set[str]:
    """The config keys that the points (sweep.json entries) set to more than one value."""
    keys = {k for p in points for k in p["overrides"]}
    return {k for k in keys if len({repr(p["overrides"].get(k)) for p in points}) > 1}


def report(out: str | Path, wandb_mode: str | None = "disabled", log: Callable[[str], None] = print) -> list[dict]:
    """Write OUT/results.csv, OUT/results.md and the plots from the point folders; with a
    wandb mode other than disabled, also a report run in the sweep's group that logs the
    table and the plots. Returns the rows."""
    from experiments import sweep_plots

    out = Path(out)
    meta, rows = collect(out)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.md").write_text(markdown(meta, rows))
    made = sweep_plots.make_plots(rows, out, swept_keys(meta["points"]), log=log)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "failed", "missing")}
    log(
        f"{counts['ok']} ok, {counts['failed']} failed, {counts['missing']} missing; wrote results.csv, results.md"
        + "".join(f", {p.name}" for p in made)
    )
    if wandb_mode and wandb_mode != "disabled":
        _wandb_report(meta, rows, made, wandb_mode, out)
    return rows


def _wandb_report(meta: dict[str, Any], rows: list[dict[str, Any]], plots: list[Path], mode: str, out: Path) -> None:
    """One run named "<sweep>-report" in the sweep's group: the results table and the plots."""
    import wandb

    from research.metrics import WandbRun

    with WandbRun(
        mode,
        meta["project"],
        meta["group"],
        f"{meta['name']}-report",
        out,
        {"sweep": meta["name"], "base": meta["base"], "points": len(rows)},
    ) as run:
        table = wandb.Table(columns=list(COLUMNS), data=[[r[c] for c in COLUMNS] for r in rows])
        run.log({"results": table, **{f"plots/{p.stem}": wandb.Image(str(p)) for p in plots}}, step=0)
        run.summary({s: sum(r["status"] == s for r in rows) for s in ("ok", "failed", "missing")})
