"""accelerate's documented training loop with ZeroOptimizer (optim.integrations.accelerate)
against the same loop with accelerate + DDP + AdamW, side by side.

Run (CPU, gloo; it starts its own rank processes, no accelerate launch needed):

    python -m experiments.bench.accelerate_loop                  # 2 ranks, stages 0-3 against DDP
    python -m experiments.bench.accelerate_loop --quick          # tiny smoke run
    python -m experiments.bench.accelerate_loop --json out.json  # also write the numbers

Each method trains the same seeded TinyGPT (experiments/bench/common.py), fp32, with the loop
accelerate documents, each under an Accelerator(cpu=True, gradient_accumulation_steps=accum)
of its own:

    for micro-batch in the step:
        with accelerator.accumulate(model):
            accelerator.backward(model(idx, tgt))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            opt.step(); sched.step(); opt.zero_grad()

    ddp      accelerator.prepare(model, AdamW, sched): DDP (accelerate's defaults) + torch's AdamW
    zero0-3  optim.integrations.accelerate.prepare(accelerator, model, ZeroOptimizer(model, AdamW,
             stage=s, ...), sched)
    plain0-3 (with --methods) the same ZeroOptimizer without accelerate, in README's plain loop
             (no_sync() on the micro-steps, torch.nn.utils.clip_grad_norm_): zeroS / plainS is
             what accelerate's loop and the integration add, zeroS / ddp minus that is the stage's own

The baseline's AdamW uses the kernel family of ZeroOptimizer's step backend (foreach for "torch",
fused for "torch_fused"), and ZeroOptimizer the options of experiments/bench/zero_vs_torch.py
(one stage-3 unit per block; find_unused_parameters=False, DDP's default promise), so that the
comparison is of the data-parallel machinery inside the same loop. Methods are interleaved
step by step (the order rotates every step); a step is `accum` micro-batches and the optimizer
step, after a barrier, timed on the slowest rank (wall clock, and CPU time: process time, which
waiting does not count, so it is steadier on a loaded machine). The goals, in the ratio of median
step times: zeroS / ddp <= 1.1 for stages 0-2, and zero3 / plain3 <= 1.1 (what accelerate's loop
and the integration add to stage 3). DDP replicates the parameters, so zero3 / ddp is the cost of
sharding them, reported only: stage 3 against torch's sharded data parallelism (FSDP2, which
accelerate runs on GPUs only) is zero_vs_torch's zero3 / fsdp2 pairing.
"""

from __future__ import annotations

import contextlib
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from experiments.bench.common import batch as make_batch
from experiments.bench.common import launch, matching_adamw, median, spread_ms, take_turns
from experiments.bench.config import TinyGPTRun, parse_config
from experiments.bench.results import finish, nonfinite, paired
from experiments.bench.tables import ratio_columns, step_time_columns, table
from research.cli import arg

METHODS = ["ddp", "zero0", "zero1", "zero2", "zero3", "plain0", "plain1", "plain2", "plain3"]
GOAL = 1.1  # ratio of median step times: zeroS / ddp for stages 0-2, zero3 / plain3


@dataclass
class Config(TinyGPTRun):
    world: int = arg(2, "ranks (gloo processes, one thread each)")
    methods: tuple[str, ...] = arg((*METHODS[:5], "plain3"), "methods to run", choices=METHODS)
    steps: int = arg(20, "timed optimizer steps per method per round")
    warmup: int = arg(3, "untimed steps before them")
    accum: int = arg(2, "micro-batches per optimizer step (accelerator.accumulate)")
    clip: float = arg(1.0, "accelerator.clip_grad_norm_ max norm")

    def problem(self) -> str | None:
        return "--world and --accum must be >= 1" if self.world < 1 or self.accum < 1 else super().problem()


def zero_options(cfg: Config) -> Any:
    """ZeroOptimizer's communication: zero_vs_torch's (one stage-3 unit per block, smaller
    units resident, DDP's promise that every parameter gets a gradient)."""
    from optim.policies import Communication

    return Communication(
        unit_numel=cfg.block_numel(),
        resident_numel=2**16 if cfg.dim >= 128 else 1024,
        find_unused_parameters=False,
    )


class Method:
    """One method's model, optimizer and scheduler, prepared by its own Accelerator."""

    def __init__(self, name: str, cfg: Config) -> None:
        from accelerate import Accelerator

        from optim import ZeroOptimizer
        from optim.integrations import accelerate as zero_accelerate

        self.cfg = cfg
        self.acc = Accelerator(cpu=True, gradient_accumulation_steps=cfg.accum)
        model = cfg.model()
        hyper = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
        if name == "ddp":
            opt = torch.optim.AdamW(model.parameters(), **hyper, **matching_adamw())
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
            self.model, self.opt, self.sched = self.acc.prepare(model, opt, sched)
        else:
            zero = ZeroOptimizer(
                model, torch.optim.AdamW, stage=int(name[-1]), communication=zero_options(cfg), **hyper
            )
            sched = torch.optim.lr_scheduler.LambdaLR(zero, lambda s: 1.0)
            self.model, self.opt, self.sched = model, zero, sched
            if name.startswith("zero"):
                self.model, self.opt, self.sched = zero_accelerate.prepare(self.acc, model, zero, sched)
        self.plain = name.startswith("plain")

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step over the micro-batches, as accelerate documents it (or README's
        plain loop); the mean loss."""
        if self.plain:
            return self.plain_step(micro)
        acc, total = self.acc, 0.0
        for idx, tgt in micro:
            with acc.accumulate(self.model):
                loss = self.model(idx, tgt)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad()
            total += loss.item()
        return total / len(micro)

    def plain_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        total = 0.0
        for i, (idx, tgt) in enumerate(micro):
            with self.opt.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                loss = self.model(idx, tgt)
                (loss / len(micro)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        return total / len(micro)


def run_rank(cfg: Config) -> dict[str, Any] | None:
    """Every round: fresh methods, then warmup + steps steps in which they take turns. Per
    method, the slowest rank's ms per timed step and the global mean loss of the last step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = cfg.micro_batch * cfg.accum  # sequences of a rank per step
    batches = [make_batch(i, mine * world, cfg.seq, cfg.vocab) for i in range(cfg.warmup + cfg.steps)]

    def step(name: str, method: Method, i: int) -> tuple[float, float, float]:
        """(wall ms, CPU ms) of the slowest rank and the global mean loss of a step."""
        idx, tgt = (t[rank * mine : (rank + 1) * mine] for t in batches[i])
        micro = [(idx[s : s + cfg.micro_batch], tgt[s : s + cfg.micro_batch]) for s in range(0, mine, cfg.micro_batch)]
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = method.step(micro)
        spent = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        mean = torch.tensor(loss, dtype=torch.float64)
        dist.all_reduce(mean)
        return float(spent[0]) * 1e3, float(spent[1]) * 1e3, float(mean) / world

    samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in cfg.methods}
    turns = take_turns(
        cfg.methods, cfg.rounds, cfg.warmup + cfg.steps, lambda _: {m: Method(m, cfg) for m in cfg.methods}, step
    )
    for round_ in turns:
        for m, steps in round_.items():
            samples[m] += steps[cfg.warmup :]
    if rank != 0:
        return None
    out = {}
    for m, s in samples.items():
        wall, cpu, _ = zip(*s)
        out[m] = {"times_ms": list(wall), **spread_ms(list(wall)), "cpu_median_ms": median(list(cpu))}
        out[m]["final_loss"] = s[-1][2]
    return out


def ratios(per_method: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """zeroS / ddp and zeroS / plainS (`results.paired`), "met" where a goal judges them."""
    zeros = [m for m in per_method if m.startswith("zero")]
    out = []
    for m, other in [(m, "ddp") for m in zeros] + [(m, f"plain{m[-1]}") for m in zeros]:
        if other in per_method:
            r = paired(per_method[m], per_method[other])
            out.append({"ours": m, "theirs": other, **r, "met": r["ratio"] <= GOAL if _has_goal(m, other) else None})
    return out


def _has_goal(ours: str, theirs: str) -> bool:
    """Stages 0-2 against DDP, stage 3 against itself outside accelerate (module docstring)."""
    return (theirs == "ddp") != (ours == "zero3")


METHOD_COLUMNS = {
    **step_time_columns("median ms / step", ".1f"),
    "cpu ms": "cpu_median_ms:.1f",
    "final loss": "final_loss:.6f",
}
RATIO_COLUMNS = ratio_columns(lambda r: f"<= {GOAL}" if r["met"] is not None else "-")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the methods on `world` ranks, print the tables and the goal; the results as --json writes them."""
    cfg, args = parse_config(Config, __doc__, argv)
    print(
        f"accelerate_loop: {cfg.describe()}, {cfg.world} gloo ranks x 1 thread, micro-batch {cfg.micro_batch}/rank, "
        f"accumulation {cfg.accum}, clip {cfg.clip}; {cfg.schedule()}; torch {torch.__version__}, {platform.machine()}"
    )
    print(
        f"  ZeroOptimizer options {zero_options(cfg)}; baseline AdamW {matching_adamw() or '(torch defaults)'}",
        flush=True,
    )
    start = time.perf_counter()
    per_method = launch(run_rank, cfg.world, cfg)[0]
    rs = ratios(per_method)
    print()
    print(table(({"method": m, **e} for m, e in per_method.items()), METHOD_COLUMNS))
    print()
    print(table(rs, RATIO_COLUMNS))
    results = {
        "config": asdict(cfg),
        "numel": cfg.numel(),
        "torch": torch.__version__,
        "methods": per_method,
        "ratios": rs,
        "seconds": time.perf_counter() - start,
    }
    print(f"total {results['seconds']:.0f} s")
    return finish(results, nonfinite(per_method, ("median_ms", "final_loss")), args.json)


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
