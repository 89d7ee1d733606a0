"""The plots of a sweep (`experiments.sweep`), from its results rows, as PNGs (matplotlib, Agg):

- `memory_vs_throughput.png`: memory per rank (the largest rank's peak) against tokens/s,
  every point tagged with a number that a key beside the axes names (tags are moved apart so
  none overlaps another), the Pareto front (no other point has both less memory and more
  throughput) in red, where throughputs within their step-to-step spread count as equal: on a
  noisy machine (a shared CPU) memory decides;
- `memory_breakdown.png`: per point, stacked bars of params / grads / master + optimizer /
  activations of that rank, sorted by ZeRO stage, one panel per dp size when dp varies;
- `throughput_vs_micro_batches.png`: tokens/s against micro-batches per step, one line per
  schedule (and per value of any other setting that varies).

A plot is made only when the finished points have what it needs; otherwise it is skipped
and the log says why.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.sweep_columns import CONFIG_COLUMNS

MiB = 2**20
PARTS = (
    ("params", "params", "#4c72b0"),
    ("grads", "grads", "#55a868"),
    ("master_and_optimizer", "master + optimizer", "#c44e52"),
    ("activations", "activations", "#8172b2"),
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_front(points: list[tuple[float, float]], spreads: list[float] | None = None) -> list[int]:
    """Indices of the (memory, throughput) points that no other point beats, by rising memory.
    a beats b when it needs no more memory and has no less throughput, and is better in one;
    two throughputs within s of each other (relative; s the larger `spreads` of the two, each
    a point's step-to-step spread, 0 without them) are equal."""
    spreads = spreads or [0.0] * len(points)

    def beats(a: int, b: int) -> bool:
        (ma, ta), (mb, tb), s = points[a], points[b], max(spreads[a], spreads[b])
        no_less = ta >= tb * (1 - s)
        return ma <= mb and no_less and (ma < mb or ta > tb * (1 + s))

    front = [b for b in range(len(points)) if not any(beats(a, b) for a in range(len(points)) if a != b)]
    return sorted(front, key=lambda i: points[i])


def _place_tags(ax: Any, fig: Any, anchors: list[tuple[float, float]], tags: list[str], fontsize: int) -> None:
    """Write each tag just above-right of its data point, moved up (in steps of its own
    height) past every tag already placed that it would overlap."""
    fig.canvas.draw()  # the data-to-pixel transform of the final axes limits
    placed: list[Any] = []
    for (x, y), tag in zip(anchors, tags):
        dy = 0
        while True:
            text = ax.annotate(tag, (x, y), xytext=(4, 4 + dy), textcoords="offset points", fontsize=fontsize)
            box = text.get_window_extent(fig.canvas.get_renderer()).expanded(1.1, 1.2)
            if not any(box.overlaps(other) for other in placed):
                placed.append(box)
                break
            text.remove()
            dy += fontsize


def _varying(rows: list[dict[str, Any]], exclude: tuple[str, ...] = ()) -> list[str]:
    return [k for k in CONFIG_COLUMNS if k not in exclude and len({str(r.get(k)) for r in rows}) > 1]


def _label(row: dict[str, Any], keys: list[str], sep: str = " ") -> str:
    """ "schedule=1f1b v=2 m=8" for the keys given ("ZeRO 3" for zero)."""
    short = {"virtual_stages": "v", "micro_batches": "m", "micro_batch_size": "mbs", "sequence_parallel": "sp"}
    return sep.join(f"ZeRO {row[k]}" if k == "zero" else f"{short.get(k, k)}={row[k]}" for k in keys)


def memory_vs_throughput(rows: list[dict[str, Any]], path: Path, swept: set[str]) -> str | None:
    """Scatter of memory per rank against tokens/s with the Pareto front; None if made, else why not."""
    ok = [r for r in rows if r["tokens_per_s"] is not None and r["mem_per_rank_bytes"] is not None]
    if len(ok) < 2:
        return f"needs 2 finished points, has {len(ok)}"
    plt = _pyplot()
    xy = [(r["mem_per_rank_bytes"] / MiB, r["tokens_per_s"]) for r in ok]
    spreads = [r.get("tokens_per_s_spread") or 0.0 for r in ok]
    front = pareto_front(xy, spreads)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.scatter([t for _, t in xy], [m for m, _ in xy], color="#4c72b0", zorder=3, label="point")
    ax.plot(
        [xy[i][1] for i in front],
        [xy[i][0] for i in front],
        "o-",
        color="#c44e52",
        mfc="none",
        ms=12,
        zorder=2,
        label=f"Pareto front (tok/s within ±{100 * max(spreads):.0f}% count as equal)",
    )
    places: dict[tuple[float, float], list[int]] = {}
    for n, at in enumerate(xy, 1):
        places.setdefault(at, []).append(n)  # points at the same place share one tag
    ax.margins(x=0.15, y=0.15)  # room for the tags
    _place_tags(ax, fig, [(t, m) for m, t in places], [",".join(map(str, ns)) for ns in places.values()], 8)
    key = "\n".join(f"{n}  {r['name']}" for n, r in enumerate(ok, 1))
    ax.text(1.02, 1.0, key, transform=ax.transAxes, va="top", fontsize=8, family="monospace")
    _finish(
        plt,
        fig,
        ax,
        path,
        "throughput (tokens/s, median over steps)",
        "memory per rank (MiB): the largest rank's peak",
        "memory vs throughput",
    )
    return None


def memory_breakdown(rows: list[dict[str, Any]], path: Path, swept: set[str]) -> str | None:
    """Stacked bars per point (by ZeRO stage, else in sweep order), a panel per dp size if dp
    varies; on top, hatched, the full gradient buckets that exist only during backward."""
    ok = [r for r in rows if r["status"] == "ok" and r["mem_per_rank_bytes"] is not None]
    if not ok:
        return "needs a finished point"
    plt = _pyplot()
    panels = sorted({r["dp"] for r in ok}) if len({r["dp"] for r in ok}) > 1 else [ok[0]["dp"]]
    derived = {"nproc", "micro_batches", "micro_batch_size"} - swept  # follow from other settings
    others = _varying(ok, exclude=("dp", *derived))
    widths = [max(1.5, sum(r["dp"] == dp for r in ok)) for dp in panels]
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(2.2 + 1.1 * sum(widths), 4.8),
        sharey=True,
        squeeze=False,
        gridspec_kw={"width_ratios": widths},
    )
    for ax, dp in zip(axes[0], panels):
        bars = sorted((r for r in ok if r["dp"] == dp), key=lambda r: r["zero"])  # stable: sweep order otherwise
        _memory_bars(ax, bars)
        _bar_ticks(ax, [_label(r, others, "\n") if others else r["name"] for r in bars])
        ax.set_title(f"dp = {dp}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.12)
    axes[0][0].set_ylabel("bytes per rank (MiB), the largest rank")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.94), ncol=3, fontsize=8, frameon=False)
    fig.suptitle("memory per rank" + (" by ZeRO stage" if "zero" in others else ""))
    fig.tight_layout(rect=(0, 0, 1, 0.91))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _memory_bars(ax: Any, bars: list[dict[str, Any]]) -> None:
    """One bar per row: the PARTS stacked (MiB), then, hatched on top, the gradient buckets
    held only during backward (grads peak - grads), labelled with the whole bar's height,
    the row's mem/rank."""
    bottom = [0.0] * len(bars)
    for key, label, color in PARTS:
        values = [r[f"mem_{key}_bytes"] / MiB for r in bars]
        ax.bar(range(len(bars)), values, bottom=bottom, color=color, label=label, width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    transient = [max(0, r["mem_grads_peak_bytes"] - r["mem_grads_bytes"]) / MiB for r in bars]
    ax.bar(
        range(len(bars)),
        transient,
        bottom=bottom,
        color="none",
        edgecolor=PARTS[1][2],
        hatch="///",
        width=0.7,
        label="full grad buckets during backward (peak)",
    )
    for i, (r, total, extra) in enumerate(zip(bars, bottom, transient)):
        ax.annotate(
            f"{r['mem_per_rank_bytes'] / MiB:.2f}",
            (i, total + extra),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            fontsize=7,
        )


def _bar_ticks(ax: Any, ticks: list[str]) -> None:
    """Tick labels under the bars, slanted when a line of one is longer than 14 characters."""
    if any(len(line) > 14 for t in ticks for line in t.split("\n")):
        ax.set_xticks(range(len(ticks)), ticks, fontsize=7, rotation=30, ha="right")
    else:
        ax.set_xticks(range(len(ticks)), ticks, fontsize=8)


def throughput_vs_micro_batches(rows: list[dict[str, Any]], path: Path, swept: set[str]) -> str | None:
    """tokens/s against micro-batches, one line per schedule (and other varying settings);
    only when the sweep varies a batch setting (micro-batches also change with dp at a fixed
    global batch, which is no micro-batch axis)."""
    if not swept & {"micro_batches", "micro_batch_size", "global_batch_size"}:
        return "the sweep does not vary micro_batches (or micro_batch_size / global_batch_size)"
    ok = [r for r in rows if r["tokens_per_s"] is not None and r["micro_batches"] is not None]
    if len({r["micro_batches"] for r in ok}) < 2:
        return "needs finished points at 2 or more micro_batches values"
    plt = _pyplot()
    keys = ["schedule", *_varying(ok, exclude=("schedule", "micro_batches", "micro_batch_size", "nproc"))]
    lines: dict[str, list[dict[str, Any]]] = {}
    for r in ok:
        lines.setdefault(_label(r, keys), []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, members in sorted(lines.items()):
        members.sort(key=lambda r: r["micro_batches"])
        ax.plot([r["micro_batches"] for r in members], [r["tokens_per_s"] for r in members], "o-", label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted({r["micro_batches"] for r in ok})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    _finish(
        plt,
        fig,
        ax,
        path,
        "micro-batches per step",
        "throughput (tokens/s)",
        "throughput vs micro-batches (pipeline bubble)",
    )
    return None


def _finish(plt: Any, fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Label one-panel axes, add grid and legend, write the PNG and close the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLOTS = (
    ("memory_vs_throughput.png", memory_vs_throughput),
    ("memory_breakdown.png", memory_breakdown),
    ("throughput_vs_micro_batches.png", throughput_vs_micro_batches),
)


def make_plots(
    rows: list[dict[str, Any]], out: Path, swept: set[str] = frozenset(), log: Callable[[str], None] = print
) -> list[Path]:
    """Write every plot the rows allow into `out` (removing stale ones that no longer apply);
    `swept`: the config keys the sweep's points set to different values. The paths written."""
    ok = [r for r in rows if r["status"] == "ok"]
    made = []
    for name, plot in PLOTS:
        path = Path(out, name)
        why_not = plot(ok, path, set(swept))
        if why_not:
            path.unlink(missing_ok=True)
            log(f"skipped {name}: {why_not}")
        else:
            made.append(path)
    return made
