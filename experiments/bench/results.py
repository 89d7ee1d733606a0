"""The results of a benchmark, one schema for every benchmark and every part of the GPU suite:
a JSON object of its setup ("config"), its records ("rows", or "methods" by name: a method's
numbers, its step times as "median_ms", "p25_ms" and "p75_ms"; "ratios" ours / theirs, with
"met" where a goal judges them), the "seconds" it took and "nonfinite", the records with a NaN
or infinite number. A part of the GPU suite adds its "status" and states its goals as `goal`
records."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from experiments.bench.common import median, percentile
from experiments.bench.tables import Cell, table


def write_json(path: str | Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def finish(results: dict[str, Any], nonfinite: list[str], json_path: str | None) -> dict[str, Any]:
    """Record the rows with non-finite numbers (printed as an error: the command then exits
    1) and write the results as JSON when asked."""
    results["nonfinite"] = nonfinite
    if nonfinite:
        print(f"ERROR: non-finite results for {', '.join(nonfinite)}", file=sys.stderr)
    if json_path:
        write_json(json_path, results)
        print(f"wrote {json_path}")
    return results


def finish_rows(
    cfg: Any,
    start: float,
    rows: list[dict[str, Any]],
    columns: dict[str, Cell],
    finite: Iterable[str],
    json_path: str | None,
    also: list[str] | None = None,
    **numbers: Any,
) -> dict[str, Any]:
    """Print the table of a benchmark's rows (a record per "method"), then `finish` its results
    {"config", **numbers, "rows", "seconds" since `start`}: the rows with a non-finite number
    under one of the keys `finite`, and the methods of `also`, make the command fail."""
    print()
    print(table(rows, columns))
    results = {"config": dataclasses.asdict(cfg), **numbers, "rows": rows, "seconds": time.perf_counter() - start}
    return finish(results, nonfinite({r["method"]: r for r in rows}, finite) + (also or []), json_path)


def nonfinite(records: Mapping[str, Mapping[str, Any]], keys: Iterable[str]) -> list[str]:
    """The names of the records with a NaN or infinite number under one of `keys` (each value
    of a dict under a key counts)."""
    keys = list(keys)

    def numbers(record: Mapping[str, Any]) -> list[float]:
        return [x for k in keys for x in (record[k].values() if isinstance(record[k], dict) else [record[k]])]

    return [name for name, r in records.items() if not all(math.isfinite(x) for x in numbers(r))]


def meets(value: float | None, op: str | None, target: float) -> bool | None:
    """Whether `value op target` holds (op "<", "<=" or ">="); None without a goal or a value."""
    if op is None or value is None:
        return None
    return {"<": value < target, "<=": value <= target, ">=": value >= target}[op]


def goal(value: float | None, op: str, target: float) -> dict[str, Any]:
    """A goal `value op target` and whether it was met (None when the value is unknown)."""
    return {"value": value, "op": op, "target": target, "met": meets(value, op, target)}


def paired(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, float]:
    """Ours / theirs of two methods' step times ("times_ms", "median_ms", "cpu_median_ms"): the
    ratio of the medians (on which goals are judged), the median and quartiles of the paired
    per-step ratios (the two steps ran back to back, so they saw the same load) and the ratio
    of the median CPU times."""
    steps = [a / b for a, b in zip(ours["times_ms"], theirs["times_ms"])]
    return {
        "ratio": ours["median_ms"] / theirs["median_ms"],
        "paired_median": median(steps),
        "paired_p25": percentile(steps, 25),
        "paired_p75": percentile(steps, 75),
        "cpu_ratio": ours["cpu_median_ms"] / theirs["cpu_median_ms"],
    }
