"""Step time of an MoE GPT at ep 1, 2 and 4 against the dense GPT of the same active FLOPs,
on 4 gloo ranks (CPU), measured side by side in one run.

    python -m experiments.bench.moe_step            # defaults below (~1 min on 2 cores)
    python -m experiments.bench.moe_step --quick    # smoke run

Methods, each a GPT trained by ZeroOptimizer (stage 1) over the 4 data-parallel ranks:
    dense     the GPT with its dense MLPs (width f)
    moe_ep1   every other block an MoE MLP of E experts of width f / k, top-k: the dense
              model's FLOPs per token plus the router; every rank holds every expert
    moe_ep2   the same, its experts split over 2 ranks (tokens exchanged by all-to-all)
    moe_ep4   over all 4
    moe_ep4_capacity  moe_ep4 with capacity factor 1: every all-to-all has the same size

Each step is one forward and backward of the rank's micro-batch, clip, step and zero_grad;
the methods take turns step by step (the order rotates). The table gives each method's
median step time, moe / dense, the all-to-all bytes of a step and the planner's formula for
them (`research.costmodel.expert_all_to_all_bytes`, four exchanges per MoE layer): dropless
runs differ by their routing's skew and the count exchange, the capacity run equals it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from experiments.bench.common import launch, median, spread_ms, step_times, take_turns
from experiments.bench.config import GPTRun, MoESizes, Rounds, parse_config
from experiments.bench.results import finish_rows
from experiments.bench.tables import step_time_columns
from parallel import accounting
from research.cli import arg

WORLD = 4
METHODS = ("dense", "moe_ep1", "moe_ep2", "moe_ep4", "moe_ep4_capacity")


@dataclass
class Config(GPTRun, MoESizes, Rounds):
    vocab: int = arg(512, "vocabulary size")
    micro_batch: int = arg(4, "sequences per rank per step")

    QUICK: ClassVar[dict[str, Any]] = Rounds.QUICK | {
        "steps": 2,
        "d_model": 32,
        "layers": 2,
        "seq": 16,
        "micro_batch": 2,
    }


def model_config(cfg: Config, method: str) -> Any:
    dense = cfg.gpt_config()
    if method == "dense":
        return dense
    return dataclasses.replace(
        dense,
        moe_experts=cfg.experts,
        moe_top_k=cfg.top_k,
        moe_every=2,
        moe_d_ff=dense.ffn_dim // cfg.top_k,
        moe_capacity_factor=1.0 if method.endswith("capacity") else None,
    )


def ep_of(method: str) -> int:
    """The expert parallelism of a method: moe_ep<N>..."""
    return int(method.split("_")[1][2:]) if method != "dense" else 1


def formula_bytes(cfg: Config, method: str) -> float:
    """The planner's all-to-all bytes of a step on a rank: 4 per MoE layer (`costmodel`)."""
    from research import costmodel

    if method == "dense":
        return 0.0
    model = model_config(cfg, method)
    layout = costmodel.Layout(dp=WORLD, ep=ep_of(method), micro_batch_size=cfg.micro_batch, precision="fp32")
    moe_layers = sum(map(model.is_moe, range(model.n_layers)))
    return 4 * moe_layers * costmodel.expert_all_to_all_bytes(model, layout, cfg.seq)


def build(cfg: Config, method: str) -> tuple[Any, Any]:
    from optim import ZeroOptimizer
    from parallel import ParallelDims
    from research.model import GPT

    dims = ParallelDims(ep=ep_of(method)).build()
    model = GPT(model_config(cfg, method), dims.tp_group, expert_groups=dims.expert_groups)
    return model, ZeroOptimizer(model, torch.optim.AdamW, stage=1, process_group=dims.dp_group, lr=1e-3)


def run_rank(cfg: Config) -> dict[str, Any] | None:
    """Per method (on rank 0): every timed step (ms), the last loss, all-to-all bytes per step."""

    gen = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq + 1), generator=gen)
    last: dict[str, dict[str, Any]] = {}

    def step(m: str, trainer: tuple[Any, Any], i: int) -> float:
        model, opt = trainer
        dist.barrier()
        t0 = time.perf_counter()
        with accounting.tracking() as log:
            loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        t = time.perf_counter() - t0
        a2a = log.as_dict().get("ep", {}).get("all_to_all_single", {}).get("bytes", 0)
        last[m] = {"loss": loss.item(), "a2a_bytes": a2a}
        return t * 1e3

    turns = take_turns(METHODS, cfg.rounds, cfg.warmup + cfg.steps, lambda r: {m: build(cfg, m) for m in METHODS}, step)
    out = {m: {**e, **last[m]} for m, e in step_times(turns, cfg.warmup).items()}
    return out if dist.get_rank() == 0 else None


def rows(cfg: Config, per_method: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    dense = median(per_method["dense"]["times_ms"])
    return [
        {
            "method": m,
            **spread_ms(e["times_ms"]),
            "over_dense": median(e["times_ms"]) / dense,
            "a2a_bytes": e["a2a_bytes"],
            "formula_bytes": formula_bytes(cfg, m),
            "loss": e["loss"],
        }
        for m, e in per_method.items()
    ]


COLUMNS = {
    **step_time_columns("step median ms", ".1f"),
    "/ dense": "over_dense:.3f",
    "all-to-all bytes / step (rank 0)": "a2a_bytes:,",
    "formula": "formula_bytes:,.0f",
    "last loss": "loss:.4f",
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg, args = parse_config(Config, __doc__, argv)
    print(
        f"moe_step: GPT d={cfg.d_model} layers={cfg.layers} seq={cfg.seq}, E={cfg.experts} top-{cfg.top_k} in every "
        f"other block; {WORLD} gloo ranks x 1 thread, ZeRO-1, micro-batch {cfg.micro_batch}/rank; {cfg.schedule()}; "
        f"torch {torch.__version__}",
        flush=True,
    )
    start = time.perf_counter()
    rs = rows(cfg, launch(run_rank, WORLD, cfg)[0])
    return finish_rows(cfg, start, rs, COLUMNS, ("median_ms",), args.json)


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
