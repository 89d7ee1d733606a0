"""The one table writer of the benchmarks and the GPU suite: `table` turns records (a dict per
row) into a plain-text table, given its columns (header -> the cell of a record)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Cell = str | Callable[[dict[str, Any]], Any]  # "key", "key:format spec", or a function of the record


def format_table(headers: list[str], rows: list[list[Any]], markdown: bool = True) -> str:
    """A Markdown table (valid plain text too), or with markdown=False aligned columns (the
    first left-aligned, the others right-aligned) without rules."""
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if not markdown:
        return "\n".join(
            "  ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:]))]) for r in cells
        )
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]])


def cell(record: dict[str, Any], spec: Cell) -> str:
    """The cell of `record`: `spec(record)`, or for spec "key" or "key:format spec" record[key]
    formatted ("-" for None or no such key)."""
    if callable(spec):
        return str(spec(record))
    key, _, fmt = spec.partition(":")
    return "-" if record.get(key) is None else format(record[key], fmt)


def table(
    records: Iterable[dict[str, Any]], columns: dict[str, Cell] | list[tuple[str, Cell]], markdown: bool = True
) -> str:
    """A row per record, a column per entry of `columns` (header -> `cell` spec; as pairs where
    two columns share a header)."""
    headers, specs = zip(*(columns.items() if isinstance(columns, dict) else columns))
    return format_table(list(headers), [[cell(r, spec) for spec in specs] for r in records], markdown)


def millis(fmt: str) -> Callable[[dict[str, Any]], str]:
    """The cell of a record's "seconds" in milliseconds."""
    return lambda r: format(1e3 * r["seconds"], fmt)


def step_time_columns(median: str, fmt: str) -> dict[str, Cell]:
    """A method's name and the median (column `median`) and quartiles of its step times
    (common.spread_ms), in milliseconds."""
    return {
        "method": "method",
        median: f"median_ms:{fmt}",
        "p25-p75 ms": lambda r: f"{r['p25_ms']:{fmt}}-{r['p75_ms']:{fmt}}",
    }


def goal_cell(met: bool | None, goal: str) -> str:
    """A table's goal column: "-" without a goal, else "<goal> (met)" or "<goal> (missed)"."""
    return "-" if met is None else f"{goal} ({'met' if met else 'missed'})"


def goal_column(goal: str) -> Cell:
    """The `goal_cell` of a record's "met"."""
    return lambda r: goal_cell(r["met"], goal)


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


def joined(key: str, fmt: str = ".2f") -> Callable[[dict[str, Any]], str]:
    """The cell of a record's list under `key`, its numbers formatted and joined by spaces."""
    return lambda r: " ".join(format(x, fmt) for x in r[key])


def ratio_columns(goal: Cell) -> dict[str, Cell]:
    """The columns of ratios ours / theirs (`results.paired`, with "ours", "theirs" and "met"),
    `goal` giving the goal's cell."""
    return {
        "ours / theirs": lambda r: f"{r['ours']} / {r['theirs']}",
        "ratio of medians": "ratio:.3f",
        "goal": goal,
        "met": lambda r: {True: "yes", False: "NO", None: "-"}[r["met"]],
        "paired median (p25-p75)": lambda r: f"{r['paired_median']:.3f} ({r['paired_p25']:.2f}-{r['paired_p75']:.2f})",
        "cpu ratio": "cpu_ratio:.3f",
    }
