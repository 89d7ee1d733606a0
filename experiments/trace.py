"""A picture of training steps: every operator and collective, attributed to the code that issued it.

    python -m experiments.trace --config experiments/configs/tiny.yaml --steps 1 --out runs/trace
    torchrun --standalone --nproc_per_node=4 -m experiments.trace --tp 2 --zero 3 --out runs/trace

Takes the training command's flags (defaults here: `--steps 2`, `--out runs/trace`, `--wandb
disabled`), builds the run as `experiments.train` does (one process without torchrun, any
layout under it) and runs its steps under a `TorchDispatchMode` and the collective accounting
(`parallel.accounting.tracking`). Each operator is attributed to the innermost frame of this
repository on the Python stack when it ran (`path/to/file.py:Class.function:line`; frames of
`parallel/comm.py`, the collectives' wrappers, and their bookkeeping are skipped so that a collective is attributed
to its caller) and to the innermost module running it, forward or backward
(`torch.utils.module_tracker.ModuleTracker`). Collectives are the accounting's calls, as op
`c10d.<name>` with the bytes this rank puts on the wire (`parallel.comm`'s table) and the
seconds of the torch.distributed calls they made (issue time for asynchronous ones; their
wait is in the operators of the frame that waits); the torch.distributed operators themselves
are not counted twice. FLOPs are `torch.utils.flop_counter`'s (matmuls and attention, CPU too; the
element-wise rest counts 0), bytes of an operator are its tensor inputs and outputs, seconds
are wall-clock (on CUDA each operator is synchronized, so they are the device's).

Writes under `--out` (rank r > 0 under `rank{r}/`):

- `ops.csv`: `site,module,op,calls,flops,bytes,time_s`, one row per (site, module, operator).
- `callgraph.svg` and `callgraph.dot`: the repository's functions that issued work (their own
  operators in the box) and the collectives, an edge per caller -> callee weighted by the
  calls, FLOPs, bytes and seconds of everything beneath it. graphviz's `dot` lays it out where
  the binary is installed; otherwise networkx and matplotlib do, with no system binary.
- `trace.json`: a `torch.profiler` chrome trace of the same steps (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import csv
import itertools
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker

from experiments import train
from parallel import accounting, comm, desync
from research.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
# the collectives' wrappers and their bookkeeping, and this file: attribute to their caller
SKIPPED = {"parallel/comm.py", "parallel/accounting.py", "parallel/flight.py", "experiments/trace.py"}
DEFAULTS = {"--steps": "2", "--out": "runs/trace", "--wandb": "disabled"}
COLUMNS = ("site", "module", "op", "calls", "flops", "bytes", "time_s")
# torch's FLOP table lacks the CPU flash-attention kernels; they do the same matmuls as the GPU ones
FLOPS = {
    **flop_registry,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(
        q.shape, k.shape, v.shape
    ),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda g, q, k, v, *_, **__: (
        sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape)
    ),
}


@dataclass
class Cost:
    """What a set of operators did: calls, FLOPs, tensor (or wire) bytes, seconds."""

    calls: int = 0
    flops: int = 0
    bytes: int = 0
    time_s: float = 0.0

    def add(self, other: Cost) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def label(self) -> str:
        return f"{self.calls} calls, {self.flops / 1e9:.3g} GFLOP, {self.bytes / 2**20:.3g} MiB, {self.time_s * 1e3:.3g} ms"


def repo_frames() -> list[tuple[str, str, int]]:
    """The stack's frames in this repository, outermost first: (path, qualified name, line)."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(str(ROOT)) and "site-packages" not in path:
            rel = os.path.relpath(path, ROOT)
            if rel not in SKIPPED:
                frames.append((rel, frame.f_code.co_qualname, frame.f_lineno))
        frame = frame.f_back
    return frames[::-1]


class StepTracer(TorchDispatchMode):
    """Counts every operator (and, through `on_collective`, every accounted collective) by
    (site, module, op) and along the chain of repository functions that led to it."""

    def __init__(self, modules: ModuleTracker) -> None:
        super().__init__()
        self.modules = modules
        self.ops: dict[tuple[str, str, str], Cost] = {}
        self.functions: dict[str, Cost] = {}  # "path:function" -> its own operators
        self.edges: dict[tuple[str, str], Cost] = {}  # caller -> callee: everything beneath
        self._c10d_s = 0.0  # seconds of torch.distributed calls not yet claimed by a collective

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        started = time.perf_counter()
        out = func(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        if func.namespace == "c10d":  # the accounting's collective stands for it
            self._c10d_s += seconds
            return out
        packet = func.overloadpacket
        flops = FLOPS[packet](*args, **kwargs, out_val=out) if packet in FLOPS else 0
        tensors = [x for x in tree_flatten((args, kwargs, out))[0] if isinstance(x, torch.Tensor)]
        self._count(str(packet), Cost(1, int(flops), sum(t.nbytes for t in tensors), seconds), leaf=False)
        return out

    def on_collective(self, group: str, op: str, payload: int, wire: int) -> None:
        """`accounting.tracking`'s callback: one collective call, `wire` bytes sent by this rank."""
        seconds, self._c10d_s = self._c10d_s, 0.0
        self._count(f"c10d.{op}", Cost(1, 0, wire, seconds), leaf=True)

    def _count(self, op: str, cost: Cost, leaf: bool) -> None:
        frames = repo_frames()
        site = f"{frames[-1][0]}:{frames[-1][1]}:{frames[-1][2]}" if frames else "(outside the repository)"
        module = max(self.modules.parents, key=lambda name: name.count("."))
        self.ops.setdefault((site, module, op), Cost()).add(cost)
        chain = list(dict.fromkeys(f"{path}:{name}" for path, name, _ in frames))
        if leaf or not chain:
            chain.append(op)
        else:
            self.functions.setdefault(chain[-1], Cost()).add(cost)
        for caller, callee in itertools.pairwise(chain):
            self.edges.setdefault((caller, callee), Cost()).add(cost)

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            for (site, module, op), c in sorted(self.ops.items(), key=lambda kv: -kv[1].time_s):
                writer.writerow([site, module, op, c.calls, c.flops, c.bytes, f"{c.time_s:.6g}"])

    def dot(self) -> str:
        """The call graph in graphviz's language: boxes for functions, ellipses for collectives."""

        def node(name: str) -> str:
            if ":" not in name:
                return f'  "{name}" [shape=ellipse, style=filled, fillcolor="#fde2c8", label="{name}"];'
            path, function = name.split(":", 1)
            own = self.functions.get(name)
            extra = f"\\nown: {own.label()}" if own else ""
            return f'  "{name}" [shape=box, style=rounded, label="{function}\\n{path}{extra}"];'

        names = dict.fromkeys([*self.functions, *(n for edge in self.edges for n in edge)])
        lines = ["digraph steps {", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];']
        lines += [node(n) for n in names]
        lines += [f'  "{a}" -> "{b}" [label="{c.label()}", fontsize=8];' for (a, b), c in self.edges.items()]
        return "\n".join([*lines, "}"]) + "\n"

    def write_svg(self, path: Path) -> str:
        """`path` (with the .dot beside it) by graphviz's dot if installed, else networkx +
        matplotlib; which one drew it."""
        dot = path.with_suffix(".dot")
        dot.write_text(self.dot())
        if shutil.which("dot"):
            subprocess.run(["dot", "-Tsvg", str(dot), "-o", str(path)], check=True)
            return "graphviz"
        self._draw(path)
        return "networkx"

    def _draw(self, path: Path) -> None:
        """Layered drawing: each function one row below its shallowest caller."""
        import matplotlib

        matplotlib.use("Agg")
        matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: searchable, small
        import matplotlib.pyplot as plt
        import networkx as nx

        graph = nx.DiGraph()
        graph.add_nodes_from(self.functions)
        for (a, b), c in self.edges.items():
            graph.add_edge(a, b, label=f"{c.calls}×, {c.time_s * 1e3:.3g} ms")
        roots = [n for n in graph if graph.in_degree(n) == 0] or list(graph)[:1]
        depth = nx.multi_source_dijkstra_path_length(graph, roots, weight=lambda *_: 1)
        layers: list[list[str]] = [[] for _ in range(max(depth.values(), default=0) + 1)]
        for n in graph:
            layers[depth.get(n, 0)].append(n)
        pos: dict[str, tuple[float, float]] = {}
        for y, layer in enumerate(layers):  # each row ordered by its callers' mean x: fewer crossings
            placed = [[pos[p][0] for p in graph.predecessors(n) if p in pos] for n in layer]
            row = [n for _, n in sorted(zip((sum(x) / len(x) if x else 0.0 for x in placed), layer))]
            pos.update({n: (1.3 * (i - (len(row) - 1) / 2), -y) for i, n in enumerate(row)})
        widest = max(map(len, layers))
        fig, ax = plt.subplots(figsize=(max(12, 3.2 * widest), max(6, 1.6 * len(layers))))
        labels = {n: n.split(":", 1)[1] + "\n" + n.split(":", 1)[0] if ":" in n else n for n in graph}
        nx.draw_networkx_edges(graph, pos, ax=ax, arrows=True, edge_color="#888888", node_size=3000)
        nx.draw_networkx_edge_labels(graph, pos, nx.get_edge_attributes(graph, "label"), ax=ax, font_size=6)
        for n, (x, y) in pos.items():
            color = "#dbe8f7" if ":" in n else "#fde2c8"
            ax.text(x, y, labels[n], ha="center", va="center", fontsize=7, bbox={"boxstyle": "round", "fc": color})
        ax.set_axis_off()
        fig.savefig(path, bbox_inches="tight")
        plt.close(fig)


def _with_defaults(argv: list[str]) -> list[str]:
    given = {a.split("=", 1)[0] for a in argv}
    return [x for flag, value in DEFAULTS.items() if flag not in given for x in (flag, value)] + argv


def trace(argv: list[str] | None = None) -> Path:
    """Run the steps of `argv`'s training run traced; the folder this rank wrote."""
    cfg = train.join(_with_defaults(list(sys.argv[1:] if argv is None else argv)))
    rank = dist.get_rank()
    out = Path(cfg.log.out) / (f"rank{rank}" if rank else "")
    out.mkdir(parents=True, exist_ok=True)
    with desync.report_timeouts(cfg.parallel.comm_timeout):
        trainer = Trainer(cfg)
        activities = [torch.profiler.ProfilerActivity.CPU]
        activities += [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
        with ModuleTracker() as modules, torch.profiler.profile(activities=activities) as profiler:
            tracer = StepTracer(modules)
            with accounting.tracking(tracer.on_collective), tracer:
                for step in range(cfg.train.steps):
                    trainer.step(step)
        comm.barrier()
    profiler.export_chrome_trace(str(out / "trace.json"))
    tracer.write_csv(out / "ops.csv")
    drawn = tracer.write_svg(out / "callgraph.svg")
    if rank == 0:
        print(f"traced {cfg.train.steps} steps: {out}/ops.csv, callgraph.svg ({drawn}), callgraph.dot, trace.json")
    return out


def main() -> None:
    train.as_rank(trace)


if __name__ == "__main__":
    main()
