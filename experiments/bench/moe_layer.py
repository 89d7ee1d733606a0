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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from experiments.bench.common import launch, median, spread_ms, step_times, take_turns
from experiments.bench.config import MoESizes, Rounds, parse_config
from experiments.bench.results import finish_rows
from experiments.bench.tables import goal_column, step_time_columns
from research.cli import arg

GOAL = 1.0
PEERS = {"mixtral_eager": "eager", "mixtral_grouped": "grouped_mm"}  # method -> experts_implementation
AGREE = 1e-4  # the largest |y_peer - y_ours| accepted (fp32, different summation orders)


@dataclass
class Config(MoESizes, Rounds):
    d_model: int = arg(256, "hidden size h")
    d_ff: int = arg(512, "each expert's width f")
    tokens: int = arg(2048, "tokens per step (sequence × batch)")
    rounds: int = arg(8, "rounds of fresh layers")

    QUICK: ClassVar[dict[str, Any]] = Rounds.QUICK | {"d_model": 32, "d_ff": 64, "tokens": 128}


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
    max_diff = dict.fromkeys(methods, 0.0)

    def fresh(r: int) -> dict[str, Callable[[], torch.Tensor]]:
        """The methods' steps on fresh layers, each peer's output compared with ours."""
        layers = build(cfg)
        runs = {m: step_fn(m, layers[m], x, g) for m in methods}
        ref = runs["ours"]().detach()
        for m in PEERS:
            max_diff[m] = max(max_diff[m], float((runs[m]().detach() - ref).abs().max()))
        return runs

    def step(m: str, run: Callable[[], torch.Tensor], i: int) -> float:
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e3

    turns = take_turns(methods, cfg.rounds, cfg.warmup + cfg.steps, fresh, step)
    return {m: {**e, "max_diff": max_diff[m]} for m, e in step_times(turns, cfg.warmup).items()}


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


COLUMNS = {
    **step_time_columns("fwd+bwd median ms", ".2f"),
    "ours / it": "ours_over_it:.3f",
    "goal": goal_column(f"<= {GOAL}"),
    "max |y - y_ours|": "max_diff:.1e",
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg, args = parse_config(Config, __doc__, argv)
    print(
        f"moe_layer: h={cfg.d_model} f={cfg.d_ff} E={cfg.experts} k={cfg.top_k}, {cfg.tokens} tokens, fp32, SwiGLU; "
        f"{cfg.schedule()}; 1 thread; torch {torch.__version__}",
        flush=True,
    )
    start = time.perf_counter()
    rs = rows(launch(run_rank, 1, cfg)[0])
    differ = [r["method"] for r in rs if not r["max_diff"] <= AGREE]
    if differ:
        print(f"ERROR: the outputs of {', '.join(differ)} differ from ours by more than {AGREE}", file=sys.stderr)
    return finish_rows(cfg, start, rs, COLUMNS, ("median_ms",), args.json, also=differ)


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
