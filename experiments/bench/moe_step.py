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
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from experiments.bench.common import bench_parser, finish, format_table, launch, median, spread_ms
from research.cli import arg, config_from

WORLD = 4
METHODS = ("dense", "moe_ep1", "moe_ep2", "moe_ep4", "moe_ep4_capacity")


@dataclass
class Config:
    d_model: int = arg(128, "hidden size")
    layers: int = arg(4, "blocks (every other one MoE)")
    heads: int = arg(4, "attention heads")
    seq: int = arg(64, "tokens per sequence")
    vocab: int = arg(512, "vocabulary")
    experts: int = arg(8, "experts E per MoE block")
    top_k: int = arg(2, "experts per token (each of width d_ff / k)")
    micro_batch: int = arg(4, "sequences per rank per step")
    steps: int = arg(10, "timed steps per method per round")
    warmup: int = arg(2, "untimed steps before them")
    rounds: int = arg(2, "rounds of fresh models")


def model_config(cfg: Config, method: str) -> Any:
    from research.model import GPTConfig

    dense = GPTConfig(
        vocab_size=cfg.vocab, n_layers=cfg.layers, n_heads=cfg.heads, d_model=cfg.d_model, max_seq_len=cfg.seq
    )
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
    from parallel import comm

    gen = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq + 1), generator=gen)
    out = {m: {"times_ms": [], "loss": None, "a2a_bytes": 0} for m in METHODS}
    for r in range(cfg.rounds):
        trainers = {m: build(cfg, m) for m in METHODS}
        for i in range(cfg.warmup + cfg.steps):
            k = (r + i) % len(METHODS)
            for m in METHODS[k:] + METHODS[:k]:
                model, opt = trainers[m]
                dist.barrier()
                t0 = time.perf_counter()
                with comm.tracking() as log:
                    loss = model(ids[:, :-1], ids[:, 1:])
                    loss.backward()
                    opt.clip_grad_norm_(1.0)
                    opt.step()
                    opt.zero_grad()
                t = time.perf_counter() - t0
                if i >= cfg.warmup:
                    out[m]["times_ms"].append(t * 1e3)
                out[m]["loss"] = loss.item()
                out[m]["a2a_bytes"] = log.as_dict().get("ep", {}).get("all_to_all_single", {}).get("bytes", 0)
        del trainers
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


def table(rs: list[dict[str, Any]]) -> str:
    return format_table(
        [
            "method",
            "step median ms",
            "p25-p75 ms",
            "/ dense",
            "all-to-all bytes / step (rank 0)",
            "formula",
            "last loss",
        ],
        [
            [
                r["method"],
                f"{r['median_ms']:.1f}",
                f"{r['p25_ms']:.1f}-{r['p75_ms']:.1f}",
                f"{r['over_dense']:.3f}",
                f"{r['a2a_bytes']:,}",
                f"{r['formula_bytes']:,.0f}",
                f"{r['loss']:.4f}",
            ]
            for r in rs
        ],
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser(Config, __doc__, "tiny model, 1 round, few steps")
    a = p.parse_args(argv)
    cfg = config_from(Config, a)
    if a.quick:
        cfg.d_model, cfg.layers, cfg.seq, cfg.micro_batch, cfg.steps, cfg.warmup, cfg.rounds = 32, 2, 16, 2, 2, 1, 1
    print(
        f"moe_step: GPT d={cfg.d_model} layers={cfg.layers} seq={cfg.seq}, E={cfg.experts} top-{cfg.top_k} in every "
        f"other block; {WORLD} gloo ranks x 1 thread, ZeRO-1, micro-batch {cfg.micro_batch}/rank; {cfg.rounds} rounds x "
        f"{cfg.warmup} warm-up + {cfg.steps} timed steps, interleaved; torch {torch.__version__}",
        flush=True,
    )
    start = time.perf_counter()
    rs = rows(cfg, launch(run_rank, WORLD, cfg)[0])
    print()
    print(table(rs))
    results = {"config": asdict(cfg), "rows": rs, "seconds": time.perf_counter() - start}
    return finish(results, [r["method"] for r in rs if r["median_ms"] != r["median_ms"]], a.json)


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
