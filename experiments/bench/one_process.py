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

import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from experiments.bench.common import launch, median, rotated, spread_ms, step_times, take_turns
from experiments.bench.config import Rounds, parse_config
from experiments.bench.results import finish_rows
from experiments.bench.tables import goal_column, joined, step_time_columns
from research.cli import arg

GOAL = 1.1
METHODS = ("torch", "zero0", "zero1", "zero2", "zero3")


@dataclass
class Config(Rounds):
    dim: int = arg(4096, "nn.Linear(dim, dim) with bias: dim·dim + dim parameters")
    batch: int = arg(8, "rows per batch")
    rounds: int = arg(8, "rounds of fresh models; within a round the methods take turns step by step")
    lr: float = arg(1e-3, "AdamW learning rate")
    weight_decay: float = arg(0.01, "AdamW weight decay")

    QUICK: ClassVar[dict[str, Any]] = Rounds.QUICK | {"dim": 256}


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
    losses: dict[str, float] = {}

    def step(m: str, trainer: tuple[torch.nn.Module, torch.optim.Optimizer], i: int) -> float:
        model, opt = trainer
        loss = model(batches[i % 2]).square().mean()
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        t = time.perf_counter() - t0
        opt.zero_grad()
        losses[m] = loss.item()
        return t * 1e3

    # the build order rotates too: which memory each gets
    turns = take_turns(
        METHODS, cfg.rounds, cfg.warmup + cfg.steps, lambda r: {m: build(m, cfg) for m in rotated(METHODS, r)}, step
    )
    return {m: {**e, "loss": losses[m]} for m, e in step_times(turns, cfg.warmup).items()}


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


COLUMNS = {
    **step_time_columns("step median ms", ".1f"),
    "ours / torch": "ratio:.3f",
    "goal": goal_column(f"<= {GOAL}"),
    "per-round ratios": joined("round_ratios"),
    "last loss": "loss:.6f",
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg, args = parse_config(Config, __doc__, argv)
    numel = cfg.dim * cfg.dim + cfg.dim
    print(
        f"one_process: nn.Linear({cfg.dim}, {cfg.dim}) ({numel:,} params, fp32), batch {cfg.batch}, "
        f"AdamW lr={cfg.lr} wd={cfg.weight_decay}; {cfg.schedule()}; 1 gloo process, 1 thread; "
        f"torch {torch.__version__}",
        flush=True,
    )
    start = time.perf_counter()
    rs = rows(launch(run_rank, 1, cfg)[0])
    return finish_rows(cfg, start, rs, COLUMNS, ("median_ms", "loss"), args.json, numel=numel)


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
