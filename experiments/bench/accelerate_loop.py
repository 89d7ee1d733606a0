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

import argparse
import contextlib
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from experiments.bench.common import batch as make_batch
from experiments.bench.common import (
    bench_parser,
    finish,
    format_table,
    launch,
    make_model,
    median,
    percentile,
    spread_ms,
)
from research.cli import arg, config_from

METHODS = ["ddp", "zero0", "zero1", "zero2", "zero3", "plain0", "plain1", "plain2", "plain3"]
GOAL = 1.1  # ratio of median step times: zeroS / ddp for stages 0-2, zero3 / plain3


@dataclass
class Config:
    world: int = arg(2, "ranks (gloo processes, one thread each)")
    methods: tuple[str, ...] = arg((*METHODS[:5], "plain3"), "methods to run", choices=METHODS)
    steps: int = arg(20, "timed optimizer steps per method per round")
    warmup: int = arg(3, "untimed steps before them")
    rounds: int = arg(2, "rounds of fresh models")
    accum: int = arg(2, "micro-batches per optimizer step (accelerator.accumulate)")
    clip: float = arg(1.0, "accelerator.clip_grad_norm_ max norm")
    dim: int = arg(256, "TinyGPT hidden size")
    layers: int = arg(4, "TinyGPT blocks")
    heads: int = arg(4, "attention heads")
    seq: int = arg(64, "tokens per sequence")
    vocab: int = arg(1024, "vocabulary size")
    micro_batch: int = arg(2, "sequences per rank per micro-batch")
    lr: float = arg(1e-3, "AdamW learning rate")
    weight_decay: float = arg(0.1, "AdamW weight decay")


def zero_options(cfg: Config) -> Any:
    """ZeroOptimizer's communication: zero_vs_torch's (one stage-3 unit per block, smaller
    units resident, DDP's promise that every parameter gets a gradient)."""
    from optim.policies import Communication

    return Communication(
        unit_numel=12 * cfg.dim * cfg.dim + 4 * cfg.dim,  # a block: qkv, proj, fc1, fc2, two LayerNorms
        resident_numel=2**16 if cfg.dim >= 128 else 1024,
        find_unused_parameters=False,
    )


def adam_kwargs() -> dict[str, Any]:
    """torch's AdamW in the kernel family of ZeroOptimizer's step backend on this machine."""
    from optim import fused

    return {"torch_fused": {"fused": True}, "torch": {"foreach": True}}.get(fused.pick_backend("cpu"), {})


class Method:
    """One method's model, optimizer and scheduler, prepared by its own Accelerator."""

    def __init__(self, name: str, cfg: Config) -> None:
        from accelerate import Accelerator

        from optim import ZeroOptimizer
        from optim.integrations import accelerate as zero_accelerate

        self.cfg = cfg
        self.acc = Accelerator(cpu=True, gradient_accumulation_steps=cfg.accum)
        model = make_model(0, cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq)
        hyper = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
        if name == "ddp":
            opt = torch.optim.AdamW(model.parameters(), **hyper, **adam_kwargs())
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
    total = cfg.warmup + cfg.steps
    batches = [make_batch(i, cfg.micro_batch * world * cfg.accum, cfg.seq, cfg.vocab) for i in range(total)]
    times: dict[str, list[float]] = {m: [] for m in cfg.methods}
    cpu: dict[str, list[float]] = {m: [] for m in cfg.methods}
    losses: dict[str, float] = {}
    for r in range(cfg.rounds):
        methods = {m: Method(m, cfg) for m in cfg.methods}
        names = list(cfg.methods)
        for i in range(total):
            idx, tgt = batches[i]
            mine = [
                (idx[s : s + cfg.micro_batch], tgt[s : s + cfg.micro_batch])
                for s in range(
                    rank * cfg.micro_batch * cfg.accum, (rank + 1) * cfg.micro_batch * cfg.accum, cfg.micro_batch
                )
            ]
            k = (r + i) % len(names)
            for m in names[k:] + names[:k]:
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                loss = methods[m].step(mine)
                spent = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
                dist.all_reduce(spent, op=dist.ReduceOp.MAX)
                if i >= cfg.warmup:
                    times[m].append(float(spent[0]) * 1e3)
                    cpu[m].append(float(spent[1]) * 1e3)
                mean = torch.tensor(loss, dtype=torch.float64)
                dist.all_reduce(mean)
                losses[m] = float(mean) / world
        del methods
    if rank != 0:
        return None
    return {
        m: {
            "times_ms": times[m],
            **spread_ms(times[m]),
            "cpu_median_ms": median(cpu[m]),
            "final_loss": losses[m],
        }
        for m in cfg.methods
    }


def ratios(per_method: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """zeroS / ddp and zeroS / plainS: the ratio of median step times (the goals' measure) and
    the median and quartiles of the paired per-step ratios (the two steps ran back to back)."""
    out = []
    pairs = [(m, "ddp") for m in per_method if m.startswith("zero")]
    pairs += [(m, f"plain{m[-1]}") for m in per_method if m.startswith("zero")]
    for m, other in pairs:
        if other not in per_method:
            continue
        ours, theirs = per_method[m], per_method[other]
        paired = [a / b for a, b in zip(ours["times_ms"], theirs["times_ms"])]
        ratio = ours["median_ms"] / theirs["median_ms"]
        out.append(
            {
                "ours": m,
                "theirs": other,
                "ratio": ratio,
                "met": ratio <= GOAL if _has_goal(m, other) else None,
                "paired_median": median(paired),
                "paired_p25": percentile(paired, 25),
                "paired_p75": percentile(paired, 75),
                "cpu_ratio": ours["cpu_median_ms"] / theirs["cpu_median_ms"],
            }
        )
    return out


def _has_goal(ours: str, theirs: str) -> bool:
    """Stages 0-2 against DDP, stage 3 against itself outside accelerate (module docstring)."""
    return (theirs == "ddp") != (ours == "zero3")


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    p = bench_parser(Config, __doc__, "tiny model, 1 round, few steps")
    a = p.parse_args(argv)
    cfg = config_from(Config, a)
    if a.quick:
        cfg.steps, cfg.warmup, cfg.rounds = 3, 1, 1
        cfg.dim, cfg.layers, cfg.heads, cfg.seq, cfg.vocab = 64, 2, 2, 32, 256
    if cfg.dim % cfg.heads:
        p.error(f"--dim={cfg.dim} is not divisible by --heads={cfg.heads}")
    if cfg.world < 1 or cfg.steps < 1 or cfg.rounds < 1 or cfg.warmup < 0 or cfg.accum < 1:
        p.error("--world, --steps, --rounds and --accum must be >= 1 and --warmup >= 0")
    return cfg, a


def print_tables(per_method: dict[str, Any], rs: list[dict[str, Any]]) -> None:
    """The per-method table, then the ratios against their goals."""
    rows = [
        [
            m,
            f"{e['median_ms']:.1f}",
            f"{e['p25_ms']:.1f}-{e['p75_ms']:.1f}",
            f"{e['cpu_median_ms']:.1f}",
            f"{e['final_loss']:.6f}",
        ]
        for m, e in per_method.items()
    ]
    print()
    print(format_table(["method", "median ms / step", "p25-p75 ms", "cpu ms", "final loss"], rows))
    print()
    rows = [
        [
            f"{r['ours']} / {r['theirs']}",
            f"{r['ratio']:.3f}",
            f"<= {GOAL}" if r["met"] is not None else "-",
            {True: "yes", False: "NO", None: "-"}[r["met"]],
            f"{r['paired_median']:.3f} ({r['paired_p25']:.2f}-{r['paired_p75']:.2f})",
            f"{r['cpu_ratio']:.3f}",
        ]
        for r in rs
    ]
    headers = ["ours / theirs", "ratio of medians", "goal", "met", "paired median (p25-p75)", "cpu ratio"]
    print(format_table(headers, rows))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the methods on `world` ranks, print the tables and the goal; the results as --json writes them."""
    cfg, args = parse_args(argv)
    numel = sum(
        p.numel() for p in dict.fromkeys(make_model(0, cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq).parameters())
    )
    print(
        f"accelerate_loop: TinyGPT dim={cfg.dim} layers={cfg.layers} seq={cfg.seq} vocab={cfg.vocab} ({numel:,} params, "
        f"fp32), {cfg.world} gloo ranks x 1 thread, micro-batch {cfg.micro_batch}/rank, accumulation {cfg.accum}, "
        f"clip {cfg.clip}; {cfg.rounds} rounds x {cfg.warmup} warm-up + {cfg.steps} timed steps, interleaved; "
        f"torch {torch.__version__}, {platform.machine()}"
    )
    print(
        f"  ZeroOptimizer options {zero_options(cfg)}; baseline AdamW {adam_kwargs() or '(torch defaults)'}", flush=True
    )
    start = time.perf_counter()
    per_method = launch(run_rank, cfg.world, cfg)[0]
    rs = ratios(per_method)
    print_tables(per_method, rs)
    results = {
        "config": asdict(cfg),
        "numel": numel,
        "torch": torch.__version__,
        "methods": per_method,
        "ratios": rs,
        "seconds": time.perf_counter() - start,
    }
    print(f"total {results['seconds']:.0f} s")
    nonfinite = [
        m for m, e in per_method.items() if not (math.isfinite(e["median_ms"]) and math.isfinite(e["final_loss"]))
    ]
    return finish(results, nonfinite, args.json)


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
