"""Pictures of a pipeline run: a PNG Gantt chart and a chrome://tracing JSON.

Both take events ``(rank, kind, microbatch, chunk, start_s, end_s)``, as produced by
``simulate`` or measured by an executor, or a ``SimResult`` (its ``events``).
matplotlib is imported only when a PNG is drawn, with the Agg backend (no display).
"""

from __future__ import annotations

import json

# forward blues, backward (input grad / full) greens, weight grad oranges; darker = later chunk
_COLORS = {
    "F": ("#9ecae1", "#4292c6", "#2171b5", "#08519c"),
    "B": ("#a1d99b", "#41ab5d", "#238b45", "#006d2c"),
    "W": ("#fdae6b", "#f16913", "#d94801", "#a63603"),
}


def _events(result) -> list[tuple]:
    return list(result.events if hasattr(result, "events") else result)


def timeline_png(result, path: str, title: str = "") -> None:
    """One row per rank (rank 0 on top), one box per compute action labelled with its
    micro-batch; the shade tells the chunk when v > 1; idle time stays white."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = _events(result)
    ranks = 1 + max(e[0] for e in events)
    chunks = 1 + max(e[3] for e in events)
    t0, t1 = min(e[4] for e in events), max(e[5] for e in events)
    per_rank = len(events) / ranks
    fig, ax = plt.subplots(figsize=(min(max(6.0, 0.28 * per_rank + 3), 26), 0.55 * ranks + 1.2))
    for rank, kind, mb, chunk, start, end in events:
        color = _COLORS.get(kind, ("#bbbbbb",) * 4)[chunk % 4]
        ax.broken_barh(
            [(start - t0, end - start)], (rank - 0.4, 0.8), facecolors=color, edgecolors="black", linewidth=0.4
        )
        ax.text((start + end) / 2 - t0, rank, str(mb), ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, t1 - t0)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_xlabel("time")
    kinds = [k for k in "FBW" if any(e[1] == k for e in events)]
    names = {"F": "forward", "B": "backward" if "W" not in kinds else "backward (input)", "W": "weight grad"}
    handles = [
        Patch(facecolor=_COLORS[k][c % 4], edgecolor="black", label=names[k] + (f" chunk {c}" if chunks > 1 else ""))
        for k in kinds
        for c in range(chunks)
    ]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def chrome_trace(events, path: str) -> None:
    """chrome://tracing / Perfetto JSON: one process per rank (pid = rank), one complete ("X")
    event per compute action, ts and dur in microseconds."""
    out = []
    for rank, kind, mb, chunk, start, end in _events(events):
        out.append(
            {
                "name": f"{kind}{mb}" + (f".{chunk}" if chunk else ""),
                "cat": kind,
                "ph": "X",
                "pid": rank,
                "tid": 0,
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "args": {"microbatch": mb, "chunk": chunk},
            }
        )
    ranks = sorted({e["pid"] for e in out})
    meta = [{"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"pp rank {r}"}} for r in ranks]
    with open(path, "w") as f:
        json.dump({"traceEvents": meta + out, "displayTimeUnit": "ms"}, f)
