"""The Mixture-of-Experts layer's forward + backward against a maintained peer in the same
process, on the same shapes and weights (CPU, 1 thread).

    python -m experiments.bench.moe_layer            # defaults below
    python -m experiments.bench.moe_layer --quick    # smoke run

Methods (SwiGLU experts, top-k router with the k weights renormalized, dropless):
    ours             research.moe.MoE (grouped GEMM over the sorted tokens; its Switch and
                     z-loss computed too)
    mixtral_eager    transformers' MixtralSparseMoeBlock, one matmul per expert hit
    mixtral_grouped  the same block with experts_implementation="grouped_mm"

torchtitan's MoE (PyPI 0.3.0) needs its own `spmd_types` and DTensor stack, so the
transformers block is the peer here. Each round builds the methods afresh with the same
weights (ours copied into the block's layout: gate_up_proj = [gate; up], down_proj
transposed) and checks that their outputs agree; then the methods take turns step by step
(the order rotates), each step one forward and backward of sum(y · g). The table gives each
method's median ms and ours / theirs (goal ≤ 1.0).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from experiments.bench.common import bench_parser, finish, format_table, goal_cell, launch, median, spread_ms
from research.cli import arg, config_from

GOAL = 1.0
PEERS = {"mixtral_eager": "eager", "mixtral_grouped": "grouped_mm"}  # method -> experts_implementation
AGREE = 1e-4  # the largest |y_peer - y_ours| accepted (fp32, different summation orders)


@dataclass
class Config:
    d_model: int = arg(256, "hidden size h")
    d_ff: int = arg(512, "each expert's width f")
    experts: int = arg(8, "experts E")
    top_k: int = arg(2, "experts per token")
    tokens: int = arg(2048, "tokens per step (sequence × batch)")
    steps: int = arg(10, "timed steps per method per round")
    warmup: int = arg(2, "untimed steps before them")
    rounds: int = arg(8, "rounds of fresh layers")


def ours(cfg: Config) -> torch.nn.Module:
    from research.moe import MoE, MoEConfig

    torch.manual_seed(0)
    return MoE(MoEConfig(cfg.d_model, cfg.experts, cfg.top_k, cfg.d_ff, swiglu=True, aux_loss_coeff=0.01))


def mixtral(cfg: Config, layer: torch.nn.Module, implementation: str) -> torch.nn.Module:
    """transformers' Mixtral block holding `layer`'s weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_local_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        router_jitter_noise=0.0,
    )
    config._experts_implementation = implementation
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(layer.experts.up.flatten(2).transpose(1, 2))  # [E, h, {gate, up}, f]
        block.experts.down_proj.copy_(layer.experts.down.transpose(1, 2))
    return block


def step_fn(name: str, layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> Any:
    """One forward + backward of the same tokens, in each layer's own layout (ours
    sequence-first [s, b, h], the block batch-first); returns the output as [s, b, h]."""
    if name == "ours":

        def run() -> torch.Tensor:
            y, aux = layer(x)
            ((y * g).sum() + aux).backward()
            return y

        return run
    x_bsh = x.detach().transpose(0, 1).contiguous().requires_grad_()
    g_bsh = g.transpose(0, 1).contiguous()

    def run_block() -> torch.Tensor:
        y = layer(x_bsh)
        (y * g_bsh).sum().backward()
        return y.transpose(0, 1)

    return run_block


def build(cfg: Config) -> dict[str, Any]:
    base = ours(cfg)
    return {"ours": base, **{name: mixtral(cfg, base, impl) for name, impl in PEERS.items()}}


def run_rank(cfg: Config) -> dict[str, Any]:
    """Per method: every timed step (ms) and each round's median; the largest difference of
    a peer's output from ours."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(cfg.tokens // 8, 8, cfg.d_model, generator=gen, requires_grad=True)
    g = torch.randn(cfg.tokens // 8, 8, cfg.d_model, generator=gen)
    methods = ("ours", *PEERS)
    out: dict[str, dict[str, Any]] = {m: {"times_ms": [], "round_medians_ms": [], "max_diff": 0.0} for m in methods}
    for r in range(cfg.rounds):
        layers = build(cfg)
        runs = {m: step_fn(m, layers[m], x, g) for m in methods}
        ref = runs["ours"]().detach()
        for m in PEERS:
            out[m]["max_diff"] = max(out[m]["max_diff"], float((runs[m]().detach() - ref).abs().max()))
        times: dict[str, list[float]] = {m: [] for m in methods}
        for i in range(cfg.warmup + cfg.steps):
            k = (r + i) % len(methods)
            for m in methods[k:] + methods[:k]:
                t0 = time.perf_counter()
                runs[m]()
                t = time.perf_counter() - t0
                if i >= cfg.warmup:
                    times[m].append(t * 1e3)
        for m in methods:
            out[m]["times_ms"] += times[m]
            out[m]["round_medians_ms"].append(median(times[m]))
    return out


def rows(per_method: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method its median and quartiles; per peer ours / theirs of the medians."""
    mine = median(per_method["ours"]["times_ms"])
    out = []
    for m, e in per_method.items():
        ratio = None if m == "ours" else mine / median(e["times_ms"])
        out.append(
            {
                "method": m,
                **spread_ms(e["times_ms"]),
                "ours_over_it": ratio,
                "met": None if ratio is None else ratio <= GOAL,
                "max_diff": e["max_diff"],
            }
        )
    return out


def table(rs: list[dict[str, Any]]) -> str:
    return format_table(
        ["method", "fwd+bwd median ms", "p25-p75 ms", "ours / it", "goal", "max |y - y_ours|"],
        [
            [
                r["method"],
                f"{r['median_ms']:.2f}",
                f"{r['p25_ms']:.2f}-{r['p75_ms']:.2f}",
                "-" if r["ours_over_it"] is None else f"{r['ours_over_it']:.3f}",
                goal_cell(r["met"], f"<= {GOAL}"),
                f"{r['max_diff']:.1e}",
            ]
            for r in rs
        ],
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser(Config, __doc__, "small layer, 1 round, few steps")
    a = p.parse_args(argv)
    cfg = config_from(Config, a)
    if a.quick:
        cfg.d_model, cfg.d_ff, cfg.tokens, cfg.steps, cfg.warmup, cfg.rounds = 32, 64, 128, 3, 1, 1
    print(
        f"moe_layer: h={cfg.d_model} f={cfg.d_ff} E={cfg.experts} k={cfg.top_k}, {cfg.tokens} tokens, fp32, SwiGLU; "
        f"{cfg.rounds} rounds x {cfg.warmup} warm-up + {cfg.steps} timed steps, interleaved; 1 thread; "
        f"torch {torch.__version__}",
        flush=True,
    )
    start = time.perf_counter()
    rs = rows(launch(run_rank, 1, cfg)[0])
    print()
    print(table(rs))
    results = {"config": asdict(cfg), "rows": rs, "seconds": time.perf_counter() - start}
    differ = [r["method"] for r in rs if not r["max_diff"] <= AGREE]
    if differ:
        print(f"ERROR: the outputs of {', '.join(differ)} differ from ours by more than {AGREE}", file=sys.stderr)
    return finish(results, [r["method"] for r in rs if r["median_ms"] != r["median_ms"]] + differ, a.json)


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
