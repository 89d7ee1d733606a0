"""Pipeline bubble of our PipelineExecutor, against theory, the simulator and torch's own
pipelining schedules.

Run (CPU, gloo; it starts its own --pp rank processes, no torchrun needed):

    python -m experiments.bench.pipeline_bubble                  # pp=4, m = 4, 8, 16, 32
    python -m experiments.bench.pipeline_bubble --quick          # smoke run
    python -m experiments.bench.pipeline_bubble --json out.json --png timeline_1f1b_m8.png

What runs: a GPT from `research.model` (fp32; sizes: see the flags) split by
`pipeline_chunks` over pp ranks, with schedule "1f1b" (v=1) and "interleaved-1f1b"
(v = --virtual-stages chunks per rank), for m = factor × p micro-batches (--m-factors).
Forward + backward only (no optimizer: the bubble lives in the pipeline
part of a step; the weights stay fixed, so both implementations see the same model).

For every (schedule, m) two implementations are built from the same seeded chunks and
take turns step by step (the order alternates), so that they share the machine's noise:

    ours    parallel.pipeline.executor.PipelineExecutor(chunks, schedule, m, pp_group)
    torch   torch.distributed.pipelining.PipelineStage per chunk (stage index c·p + rank,
            the same placement) + Schedule1F1B / ScheduleInterleaved1F1B, loss_fn = the
            last chunk's own cross-entropy, scale_grads=True (ours scales the loss by 1/m)

A step starts after a barrier; its time is the slowest rank's wall time for the pipeline
call. Per (schedule, m) the table shows, over the timed steps (after --warmup untimed):

    idle meas.   from our executor's `events` (an action starts once its input has arrived):
                 per step, makespan = last compute end - first compute start over all ranks;
                 per rank 1 - busy / makespan; mean over ranks; then the median over steps
    theory       (p-1)/(m+p-1) for 1F1B, (p-1)/(v·m+p-1) interleaved: the idle share of the
                 makespan with equal stages and free communication
    sim          parallel.pipeline.simulate with the measured mean per-micro-batch forward /
                 backward time of one rank (t_f, t_b: mean F / B action time × v) and t_comm=0
    ours / torch median step time (ms) and the ratio of medians (< 1: ours is faster)

The machine matters: with 4 ranks on 2 CPU cores, ranks compete for cores whenever more
than two of them compute at once. Compute actions then take longer in the steady state than
in the ramp-up / drain phases, and waiting includes time spent descheduled, so measured idle
fractions are not the bubble of a dedicated-core pipeline; they are reported as measured.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from experiments.bench.common import batch as make_batch
from experiments.bench.common import launch, median, percentile, take_turns
from experiments.bench.config import GPTRun, parse_config
from experiments.bench.results import finish, nonfinite
from experiments.bench.tables import table
from research.cli import arg
from research.costmodel import num_params

SCHEDULES = {"1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}
IMPLEMENTATIONS = ("ours", "torch")
CAVEAT = (
    "{world} ranks on {cores} CPU core(s): ranks compete for cores, so compute actions are slower while "
    "several ranks compute at once and the measured idle fractions include CPU contention; they are not "
    "the bubble of a pipeline with one dedicated device per rank."
)
COLUMNS = {
    "schedule": "schedule",
    "v": "v",
    "m": "m",
    "idle meas.": "idle_measured:.3f",
    "idle theory": "idle_theory:.3f",
    "idle sim": "idle_sim:.3f",
    "t_f ms": "t_f_ms:.2f",
    "t_b ms": "t_b_ms:.2f",
    "makespan ms": "makespan_ms:.1f",
    "sim makespan ms": "sim_makespan_ms:.1f",
    "ours ms": "ours_ms:.1f",
    "torch ms": "torch_ms:.1f",
    "ours / torch": "ratio:.3f",
}


@dataclass
class Config(GPTRun):
    pp: int = arg(4, "pipeline ranks (processes)")
    virtual_stages: int = arg(2, "v of interleaved-1f1b")
    m_factors: tuple[int, ...] = arg((1, 2, 4, 8), "micro-batches m = factor x pp")
    layers: int = arg(8, "transformer blocks")
    vocab: int = arg(256, "vocabulary size")
    warmup: int = arg(1, "untimed steps before the timed ones")
    steps: int = arg(6, "timed steps per implementation per (schedule, m)")

    QUICK: ClassVar[dict[str, Any]] = {"d_model": 32, "seq": 16, "warmup": 1, "steps": 2}

    @property
    def png_m(self) -> int:
        """The 1F1B run whose measured timeline --png draws: m = 2p."""
        return 2 * self.pp

    def schedules(self) -> list[tuple[str, int]]:
        return [("1f1b", 1), ("interleaved-1f1b", self.virtual_stages)]

    def microbatches(self) -> list[int]:
        return [f * self.pp for f in self.m_factors]

    def problem(self) -> str | None:
        if self.pp < 2:
            return f"--pp={self.pp}: a pipeline needs at least 2 ranks"
        if self.layers % (self.pp * self.virtual_stages):
            return f"--layers={self.layers} must split evenly into pp x v = {self.pp * self.virtual_stages} stages"
        if self.steps < 1 or self.warmup < 1 or min(self.m_factors) < 1:
            return "--steps, --warmup and --m-factors must be >= 1 (torch's stages infer shapes on the first step)"
        return None


def theory(pp: int, m: int, v: int) -> float:
    """Idle share of the makespan, equal stages, free communication: (p-1)/(v·m+p-1)."""
    return (pp - 1) / (v * m + pp - 1)


# ---------------------------------------------------------------------------------------
# What every rank runs
# ---------------------------------------------------------------------------------------


class Chunks:
    """This rank's v chunks of the seeded GPT (`research.model.pipeline_chunks`)."""

    def __init__(self, cfg: Config, dims: Any, v: int) -> None:
        from research.model import pipeline_chunks

        self.chunks = pipeline_chunks(
            cfg.gpt_config(vocab_multiple=64), dims.pp_rank, dims.pp, v, dims.tp_group, dims.embedding_group
        )

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=True)


class Ours(Chunks):
    def __init__(self, cfg: Config, dims: Any, name: str, v: int, m: int) -> None:
        from parallel.pipeline.executor import PipelineExecutor

        super().__init__(cfg, dims, v)
        self.cfg, self.m = cfg, m
        self.executor = PipelineExecutor(self.chunks, name, m, dims.pp_group)

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> float | None:
        mb = self.cfg.micro_batch
        inputs = [ids[i * mb : (i + 1) * mb] for i in range(self.m)]
        targets = [labels[i * mb : (i + 1) * mb] for i in range(self.m)]
        self.t0 = time.perf_counter()
        loss = self.executor.run(inputs, targets, (self.cfg.seq, mb, self.cfg.d_model))
        return None if loss is None else float(loss)

    def events(self) -> list[tuple]:
        """This step's compute actions with absolute perf_counter times (comparable across
        the local processes: CLOCK_MONOTONIC). The executor's event times count from the
        start of its run, which begins right after `t0` (the offset is the call itself)."""
        return [(r, k, i, c, self.t0 + s, self.t0 + e) for r, k, i, c, s, e in self.executor.events]


class Torch(Chunks):
    """torch.distributed.pipelining over the same chunks (a fresh, identically seeded copy)."""

    def __init__(self, cfg: Config, dims: Any, name: str, v: int, m: int) -> None:
        from torch.distributed import pipelining

        from parallel.pipeline.schedules import stage_of

        super().__init__(cfg, dims, v)
        n_stages = dims.pp * v
        self.stages = [
            pipelining.PipelineStage(
                chunk, stage_of(dims.pp_rank, c, dims.pp), n_stages, torch.device("cpu"), group=dims.pp_group
            )
            for c, chunk in enumerate(self.chunks)
        ]
        head = self.chunks[-1]  # GPT.loss needs only the config and the (size-1) tp group

        def loss_fn(logits_bsv: torch.Tensor, labels_bs: torch.Tensor) -> torch.Tensor:
            return head.loss(logits_bsv.transpose(0, 1), labels_bs.t())

        cls = getattr(pipelining, SCHEDULES[name])
        first = self.stages if v > 1 else self.stages[0]
        self.schedule = cls(first, m, loss_fn=loss_fn, scale_grads=True)
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        args = (ids,) if self.has_first else ()
        target = labels if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False)
        return float(torch.stack(losses).detach().mean()) if self.has_last else None


def run_schedule(cfg: Config, dims: Any, name: str, v: int, m: int) -> dict[str, Any]:
    """Ours and torch's implementation of (schedule, m) taking turns step by step: per timed
    step the slowest rank's wall seconds of each, and every rank's losses and our events."""
    batches = [make_batch(i, m * cfg.micro_batch, cfg.seq, cfg.vocab) for i in range(cfg.warmup + cfg.steps)]

    def step(key: str, impl: Ours | Torch, i: int) -> tuple[float, float | None, list[tuple] | None]:
        impl.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        loss = impl.step(*batches[i])
        wall = time.perf_counter() - t0
        return wall, loss, impl.events() if isinstance(impl, Ours) else None

    def build(r: int) -> dict[str, Ours | Torch]:
        impls = {"ours": Ours(cfg, dims, name, v, m), "torch": Torch(cfg, dims, name, v, m)}
        gc.collect()
        return impls

    (steps,) = take_turns(IMPLEMENTATIONS, 1, cfg.warmup + cfg.steps, build, step)
    timed = {key: steps[key][cfg.warmup :] for key in IMPLEMENTATIONS}
    walls = torch.tensor([[s[0] for s in timed[key]] for key in IMPLEMENTATIONS], dtype=torch.float64)
    dist.all_reduce(walls, op=dist.ReduceOp.MAX)  # per step, the slowest rank
    mine = {"events": [s[2] for s in timed["ours"]], **{f"loss_{key}": [s[1] for s in timed[key]] for key in timed}}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {
        "schedule": name,
        "v": v,
        "m": m,
        "ours_s": walls[0].tolist(),
        "torch_s": walls[1].tolist(),
        "ranks": gathered,
    }


def run_rank(cfg: Config) -> list[dict[str, Any]] | None:
    from parallel import ParallelDims

    dims = ParallelDims(pp=cfg.pp).build()
    out = [run_schedule(cfg, dims, name, v, m) for name, v in cfg.schedules() for m in cfg.microbatches()]
    return out if dist.get_rank() == 0 else None


# ---------------------------------------------------------------------------------------
# Analysis (rank 0's gathered records -> one row per (schedule, m))
# ---------------------------------------------------------------------------------------


def step_idle(events: list[tuple], pp: int) -> tuple[float, list[float], float]:
    """(mean idle fraction over ranks, per-rank idle fractions, makespan s) of one step."""
    start, end = min(e[4] for e in events), max(e[5] for e in events)
    span = end - start
    busy = [0.0] * pp
    for r, _, _, _, s, e in events:
        busy[r] += e - s
    idle = [1.0 - b / span for b in busy]
    return sum(idle) / pp, idle, span


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    from parallel.pipeline.simulate import simulate

    name, v, m, pp = raw["schedule"], raw["v"], raw["m"], cfg.pp
    steps = [[e for rank in raw["ranks"] for e in rank["events"][k]] for k in range(cfg.steps)]
    per_step = [step_idle(ev, pp) for ev in steps]
    idles = [s[0] for s in per_step]
    durations = {kind: [e[5] - e[4] for ev in steps for e in ev if e[1] == kind] for kind in ("F", "B")}
    t_f = v * sum(durations["F"]) / len(durations["F"])  # one micro-batch through one rank's chunks
    t_b = v * sum(durations["B"]) / len(durations["B"])
    sim = simulate(name, pp, m, v, t_forward=t_f, t_backward=t_b)
    ours, theirs = raw["ours_s"], raw["torch_s"]
    last = raw["ranks"][-1]  # pp rank p-1 holds the last virtual stage in both schedules
    loss_diff = max(abs(a - b) for a, b in zip(last["loss_ours"], last["loss_torch"]))
    median_step = sorted(range(cfg.steps), key=lambda k: idles[k])[cfg.steps // 2]
    return {
        "schedule": name,
        "v": v,
        "m": m,
        "idle_measured": median(idles),
        "idle_p25": percentile(idles, 25),
        "idle_p75": percentile(idles, 75),
        "idle_per_rank": [median([s[1][r] for s in per_step]) for r in range(pp)],
        "idle_theory": theory(pp, m, v),
        "idle_sim": sim.bubble_fraction,
        "t_f_ms": t_f * 1e3,
        "t_b_ms": t_b * 1e3,
        "makespan_ms": median([s[2] for s in per_step]) * 1e3,
        "sim_makespan_ms": sim.makespan * 1e3,
        "ours_ms": median(ours) * 1e3,
        "torch_ms": median(theirs) * 1e3,
        "ours_p25_ms": percentile(ours, 25) * 1e3,
        "ours_p75_ms": percentile(ours, 75) * 1e3,
        "torch_p25_ms": percentile(theirs, 25) * 1e3,
        "torch_p75_ms": percentile(theirs, 75) * 1e3,
        "ratio": median(ours) / median(theirs),
        "paired_ratio_median": median([a / b for a, b in zip(ours, theirs)]),
        "loss_max_abs_diff": loss_diff,
        "_median_step_events": steps[median_step],
    }


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every (schedule, m) on cfg.pp ranks, print the table; the results as --json writes them."""
    png = ("--png", {"metavar": "PATH", "help": "draw the measured timeline of 1F1B at m = 2p (median-idle step)"})
    cfg, args = parse_config(Config, __doc__, argv, png)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    caveat = CAVEAT.format(world=cfg.pp, cores=cores)
    print_setup(cfg, cores, caveat)
    start = time.perf_counter()
    raw = launch(run_rank, cfg.pp, cfg, threads=1)[0]
    rows = [analyse(cfg, r) for r in raw]
    elapsed = time.perf_counter() - start
    print()
    print(table(rows, COLUMNS))
    worst = max(r["loss_max_abs_diff"] for r in rows)
    print(
        f"\nlosses of ours and torch agree to {worst:.2e} (max |diff| over steps and rows; same weights, same batches)"
    )
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(
        f"total {elapsed:.0f} s; load average at the end {load[0]:.1f} / {load[1]:.1f} (1 / 5 min; "
        f"this benchmark alone keeps ~{cfg.pp} ranks busy)"
    )
    if args.png:
        draw_timeline(cfg, rows, args.png, cores)
    for r in rows:
        r.pop("_median_step_events")
    results = {
        "config": asdict(cfg),
        "torch": torch.__version__,
        "cores": cores,
        "caveat": caveat,
        "argv": sys.argv[1:] if argv is None else argv,
        "rows": rows,
        "seconds": elapsed,
        "loadavg_end": list(load),
    }
    keys = ("idle_measured", "idle_sim", "ours_ms", "torch_ms", "ratio", "loss_max_abs_diff")
    return finish(results, nonfinite({f"{r['schedule']} m={r['m']}": r for r in rows}, keys), args.json)


def print_setup(cfg: Config, cores: int, caveat: str) -> None:
    """The model, the steps, the machine (with the caveat when ranks outnumber cores) and
    what the idle columns mean."""
    print(
        f"pipeline_bubble: GPT layers={cfg.layers} d_model={cfg.d_model} heads={cfg.heads} seq={cfg.seq} "
        f"vocab={cfg.vocab} (fp32, {num_params(cfg.gpt_config(vocab_multiple=64)):,} params), micro-batch {cfg.micro_batch}; "
        f"pp={cfg.pp}, interleaved v={cfg.virtual_stages}; forward+backward only"
    )
    print(
        f"  {cfg.warmup} warm-up + {cfg.steps} timed steps per implementation per (schedule, m), ours and torch "
        f"alternating; gloo on CPU, 1 thread/rank; torch {torch.__version__}, {platform.machine()}, {cores} cores"
    )
    if cores < cfg.pp:
        print(f"  NOTE: {caveat}")
    print(
        "  idle: median over steps of the rank-mean of 1 - busy/makespan (our executor's events); theory "
        "(p-1)/(v*m+p-1); sim: simulate() with the measured mean t_f, t_b, t_comm=0",
        flush=True,
    )


def draw_timeline(cfg: Config, rows: list[dict[str, Any]], path: str, cores: int) -> None:
    """--png: the measured timeline of 1F1B at m = 2p (its median-idle step), times from the
    step's first compute start; nothing when that run is not among the rows."""
    row = next((r for r in rows if r["schedule"] == "1f1b" and r["m"] == cfg.png_m), None)
    if row is None:
        return
    from parallel.pipeline.timeline import timeline_png

    t0 = min(e[4] for e in row["_median_step_events"])
    events = [(r, k, i, c, s - t0, e - t0) for r, k, i, c, s, e in row["_median_step_events"]]
    timeline_png(
        events,
        path,
        title=f"measured 1F1B, pp={cfg.pp}, m={cfg.png_m} "
        f"(idle {row['idle_measured']:.2f}, theory {row['idle_theory']:.2f}; {cores}-core CPU, gloo)",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
