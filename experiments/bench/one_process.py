"""ZeroOptimizer stages 0-3 on one process against torch.optim.AdamW(fused=True).

    python -m experiments.bench.one_process            # nn.Linear(4096, 4096): 16.8M parameters
    python -m experiments.bench.one_process --quick    # smoke run

On one process (world size 1, as a script is debugged before it is launched on many ranks)
ZeroOptimizer should cost nothing over the torch optimizer: its group of one rank runs no
collective, and its step is the same fused Adam kernel on one flat buffer. One gloo process
(torch.set_num_threads(1)) trains an nn.Linear(dim, dim) with bias, fp32, on seeded batches:
"torch" with torch.optim.AdamW(fused=True), "zeroS" with ZeroOptimizer(model,
torch.optim.AdamW, stage=S, step_backend="torch_fused"), all with --lr and --weight-decay.
Each round builds every method's model and optimizer afresh (in an order that rotates
from round to round); then the methods take turns step by step (the order rotates every step): forward and backward of a mean-squared loss,
then `step()` (timed), then `zero_grad()`. The table shows per method the median `step()`
time over all timed steps of all rounds (and its quartiles), the ratio to torch's and the
ratio per round. Goal: zeroS / torch <= 1.1 for every stage. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from experiments.bench.common import bench_parser, finish, format_table, goal_cell, launch, median, spread_ms
from research.cli import arg, config_from

GOAL = 1.1
METHODS = ("torch", "zero0", "zero1", "zero2", "zero3")


@dataclass
class Config:
    dim: int = arg(4096, "nn.Linear(dim, dim) with bias: dim·dim + dim parameters")
    batch: int = arg(8, "rows per batch")
    steps: int = arg(10, "timed steps per method per round")
    warmup: int = arg(2, "untimed steps before them")
    rounds: int = arg(8, "rounds of fresh models; within a round the methods take turns step by step")
    lr: float = arg(1e-3, "AdamW learning rate")
    weight_decay: float = arg(0.01, "AdamW weight decay")


def build(method: str, cfg: Config) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(cfg.dim, cfg.dim)
    if method == "torch":
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    from optim import ZeroOptimizer

    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=int(method[4:]),
        step_backend="torch_fused",
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
    )
    return model, opt


def run_rank(cfg: Config) -> dict[str, Any]:
    """Per method: the step times (ms) of every timed step and the median of each round, and
    the last loss."""
    batches = [torch.randn(cfg.batch, cfg.dim, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    out: dict[str, dict[str, Any]] = {m: {"times_ms": [], "round_medians_ms": []} for m in METHODS}
    for r in range(cfg.rounds):
        order = METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]
        trainers = {m: build(m, cfg) for m in order}  # the build order rotates too: which memory each gets
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for i in range(cfg.warmup + cfg.steps):
            k = (r + i) % len(METHODS)
            for m in METHODS[k:] + METHODS[:k]:
                model, opt = trainers[m]
                loss = model(batches[i % 2]).square().mean()
                loss.backward()
                t0 = time.perf_counter()
                opt.step()
                t = time.perf_counter() - t0
                opt.zero_grad()
                out[m]["loss"] = loss.item()
                if i >= cfg.warmup:
                    times[m].append(t * 1e3)
        for m in METHODS:
            out[m]["times_ms"] += times[m]
            out[m]["round_medians_ms"].append(median(times[m]))
        del trainers
        gc.collect()
    return out


def rows(per_method: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: median and quartiles of its step times, and its ratio to torch's median
    (overall and per round)."""
    ref = per_method["torch"]
    ref_median = median(ref["times_ms"])
    out = []
    for m, e in per_method.items():
        ratio = median(e["times_ms"]) / ref_median
        out.append(
            {
                "method": m,
                **spread_ms(e["times_ms"]),
                "ratio": ratio,
                "round_ratios": [a / b for a, b in zip(e["round_medians_ms"], ref["round_medians_ms"])],
                "met": None if m == "torch" else ratio <= GOAL,
                "loss": e["loss"],
            }
        )
    return out


def table(rs: list[dict[str, Any]]) -> str:
    return format_table(
        ["method", "step median ms", "p25-p75 ms", "ours / torch", "goal", "per-round ratios", "last loss"],
        [
            [
                r["method"],
                f"{r['median_ms']:.1f}",
                f"{r['p25_ms']:.1f}-{r['p75_ms']:.1f}",
                f"{r['ratio']:.3f}",
                goal_cell(r["met"], f"<= {GOAL}"),
                " ".join(f"{x:.2f}" for x in r["round_ratios"]),
                f"{r['loss']:.6f}",
            ]
            for r in rs
        ],
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser(Config, __doc__, "small layer, 1 round, few steps")
    a = p.parse_args(argv)
    cfg = config_from(Config, a)
    if a.quick:
        cfg.dim, cfg.steps, cfg.warmup, cfg.rounds = 256, 3, 1, 1
    numel = cfg.dim * cfg.dim + cfg.dim
    print(
        f"one_process: nn.Linear({cfg.dim}, {cfg.dim}) ({numel:,} params, fp32), batch {cfg.batch}, "
        f"AdamW lr={cfg.lr} wd={cfg.weight_decay}; {cfg.rounds} rounds x {cfg.warmup} warm-up + {cfg.steps} "
        f"timed steps, interleaved; 1 gloo process, 1 thread; torch {torch.__version__}",
        flush=True,
    )
    start = time.perf_counter()
    per_method = launch(run_rank, 1, cfg)[0]
    rs = rows(per_method)
    print()
    print(table(rs))
    results = {"config": asdict(cfg), "numel": numel, "rows": rs, "seconds": time.perf_counter() - start}
    nonfinite = [r["method"] for r in rs if not all(map(_finite, (r["median_ms"], r["loss"])))]
    return finish(results, nonfinite, a.json)


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
