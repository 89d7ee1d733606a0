"""Context parallelism: how evenly the ring's ranks share the causal work, how activations
shrink with cp, and what a cp step costs.

    python -m experiments.bench.context_parallel            # defaults below
    python -m experiments.bench.context_parallel --quick    # smoke run

Three tables:
    balance     per cp and layout, each ring member's attention FLOPs (query-key pairs the
                causal mask allows, x 4·d per pair and head) and the time of its blocks'
                forward + backward over every hop (`parallel.context.ring.member_in_one_process`,
                in one process, no communication): the slowest member over the
                mean. zigzag (member g holds chunks g and 2cp−1−g; goal ≤ 1.05) against the
                plain contiguous ring (member g holds chunk g: ≈ 2 − 1/cp). The members take
                turns call by call, in an order that rotates, so that all see the same load.
    memory      the GPT's activations saved for backward on each rank (research.metrics.
                ActivationMeter) for the same sequences at cp 1, 2, 4 (gloo ranks): the
                largest rank over cp1's / cp (goal ≤ 1.1).
    step        forward + backward of the GPT at cp 2 on sequences of 2S tokens against cp 1
                on S tokens (the same tokens per rank; attention's quadratic part doubles),
                both on 2 ranks (cp 1: each rank its own sequences): medians over rounds that
                alternate the two. torch's context_parallel
                (torch.distributed.tensor.experimental) dispatches only the CUDA flash,
                memory-efficient and cuDNN kernels, so on the CPU cp 1 is the baseline.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from experiments.bench.common import launch, median, step_times, take_turns
from experiments.bench.config import GPTRun, parse_config
from experiments.bench.results import finish, goal
from experiments.bench.tables import mib, table
from parallel.context import kernels
from parallel.context.chunks import Block, block_kind, positions
from parallel.context.ring import member_in_one_process
from research.cli import arg

BALANCE_GOAL = 1.05
MEMORY_GOAL = 1.1


@dataclass
class Config(GPTRun):
    attention_seq: int = arg(4096, "tokens per sequence of the balance table")
    cps: tuple[int, ...] = arg((2, 4, 8), "cp sizes of the balance table")
    head_dim: int = arg(32, "head dimension of the balance table")
    repeats: int = arg(9, "timed repeats of each member's blocks (after 2 untimed)")
    seq: int = arg(1024, "tokens per sequence of the memory table, and S of the step table (cp 2 runs 2S)")
    layers: int = arg(2, "transformer blocks")
    rounds: int = arg(3, "rounds of the step table, each timing cp 1 then cp 2")
    steps: int = arg(5, "timed steps per run of the step table (after 2 untimed)")

    QUICK: ClassVar[dict[str, Any]] = {
        "attention_seq": 256,
        "cps": (2, 4),
        "repeats": 2,
        "seq": 128,
        "layers": 1,
        "d_model": 32,
        "vocab": 256,
        "rounds": 1,
        "steps": 2,
    }

    def problem(self) -> str | None:
        bad = [cp for cp in self.cps if self.attention_seq % (2 * cp)]
        if bad or self.seq % 8:
            return f"--attention-seq must split into 2·cp chunks for every cp, and --seq into 8; got {bad}"
        return None


# ---- balance --------------------------------------------------------------------------------


Held = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]


def zigzag_inputs(q, k, v, dout, cp: int, g: int) -> Held:
    """Member g's queries and output gradient, and the keys and values of every member (what
    the ring brings it), from whole-sequence q, k, v, dout [b, H, s, d]."""
    s = q.shape[-2]
    mine = positions(s, cp, g)
    kv = torch.stack((k, v))
    return q[..., mine, :], dout[..., mine, :], [kv[..., positions(s, cp, src), :] for src in range(cp)]


def zigzag_member(held: Held, g: int) -> None:
    """Member g's ring work over every hop (`zigzag_inputs`; `ring.member_in_one_process`)."""
    qg, dout, kvs = held
    member_in_one_process(qg, dout, kvs, g)


def _contiguous_member(q, k, v, dout, cp: int, g: int) -> None:
    """Member g of the plain ring (chunk g of cp): its blocks against chunks 0..g."""
    c = q.shape[-2] // cp
    part = lambda x, i: x[..., i * c : (i + 1) * c, :]  # noqa: E731
    saved, out, lse, kinds = kernels.Saved(), None, None, []
    for j in range(cp):
        kind = block_kind(g, j, c, None)
        if kind is not Block.SKIP:
            kinds.append((j, kind))
            block_out, block_lse = kernels.forward(part(q, g), part(k, j), part(v, j), kind, None, saved)
            out, lse = kernels.merge(out, lse, block_out, block_lse)
    for j, kind in kinds:
        kernels.backward(part(dout, g), part(q, g), part(k, j), part(v, j), out, lse, kind, None, saved)


def _time_call(name: str, fn: Any, step: int) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def _pairs(layout: str, s: int, cp: int, g: int) -> int:
    """Query-key pairs member g computes under the causal mask."""
    if layout == "zigzag":
        return sum(int(p) + 1 for p in positions(s, cp, g))
    c = s // cp
    return g * c * c + c * (c + 1) // 2


def balance(cfg: Config) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    shape = (1, cfg.heads, cfg.attention_seq, cfg.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=gen) for _ in range(4))
    rows = []
    for cp in cfg.cps:
        held = [zigzag_inputs(q, k, v, dout, cp, g) for g in range(cp)]
        work = {
            "zigzag": {str(g): functools.partial(zigzag_member, held[g], g) for g in range(cp)},
            "contiguous": {str(g): functools.partial(_contiguous_member, q, k, v, dout, cp, g) for g in range(cp)},
        }
        for layout, members in work.items():
            flops = [4 * cfg.head_dim * cfg.heads * _pairs(layout, cfg.attention_seq, cp, g) for g in range(cp)]
            turns = take_turns(list(members), 1, 2 + cfg.repeats, lambda _, m=members: m, _time_call)
            seconds = [median(t["times_ms"]) / 1e3 for t in step_times(turns, 2).values()]
            flop_ratio, time_ratio = max(flops) / (sum(flops) / cp), max(seconds) / (sum(seconds) / cp)
            rows.append(
                {
                    "cp": cp,
                    "layout": layout,
                    "flops": flops,
                    "ms": [1e3 * t for t in seconds],
                    "flop_ratio": flop_ratio,
                    "time_ratio": time_ratio,
                    "goal": goal(time_ratio, "<=", BALANCE_GOAL) if layout == "zigzag" else None,
                }
            )
    return rows


# ---- memory and step time on gloo ranks -----------------------------------------------------


def _model_and_batch(cfg: Config, seq: int, cp: int):
    """This rank's GPT and `micro_batch` whole sequences of `seq` tokens, of which the model
    keeps this rank's share (the other ranks than cp's read their own: data parallelism,
    without its reduction)."""
    from parallel import ParallelDims
    from research.model import GPT

    dims = ParallelDims(cp=cp).build("cpu")
    model = GPT(dataclasses.replace(cfg.gpt_config(), max_seq_len=seq), dims.tp_group, context=dims.context)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (cfg.micro_batch, seq), generator=gen)
    labels = torch.randint(0, cfg.vocab, (cfg.micro_batch, seq), generator=gen)
    return model, ids, labels


def _activations(cfg: Config) -> int:
    import torch.distributed as dist

    from research.metrics import ActivationMeter

    model, ids, labels = _model_and_batch(cfg, cfg.seq, dist.get_world_size())
    with ActivationMeter([model]) as meter:
        model(ids, labels).backward()
    return meter.peak_bytes


def _step_ms(cfg: Config, seq: int, cp: int) -> list[float]:
    model, ids, labels = _model_and_batch(cfg, seq, cp)

    def step() -> None:
        model(ids, labels).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    times = []
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def memory(cfg: Config) -> list[dict[str, Any]]:
    peaks = {cp: max(launch(_activations, cp, cfg)) for cp in (1, 2, 4)}
    return [
        {
            "cp": cp,
            "bytes": peak,
            "ratio": peak / (peaks[1] / cp),
            "goal": goal(peak / (peaks[1] / cp), "<=", MEMORY_GOAL) if cp > 1 else None,
        }
        for cp, peak in peaks.items()
    ]


def step(cfg: Config) -> dict[str, Any]:
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(cfg.rounds):  # both on 2 ranks, so that both see the same machine load
        for cp in (1, 2):
            times[cp] += max(launch(_step_ms, 2, cfg, cp * cfg.seq, cp), key=median)  # the slowest rank
    one, two = median(times[1]), median(times[2])
    per_token = cfg.gpt_config().flops_per_token
    flops = per_token(2 * cfg.seq) / per_token(cfg.seq)
    return {"cp1_ms": one, "cp2_ms": two, "ratio": two / one, "flops_ratio": flops}


BALANCE_COLUMNS = {
    "cp": "cp",
    "layout": "layout",
    "attention GFLOP per member": lambda r: " ".join(f"{f / 1e9:.3f}" for f in r["flops"]),
    "slowest / mean, FLOPs": "flop_ratio:.3f",
    "fwd+bwd ms per member": lambda r: " ".join(f"{t:.1f}" for t in r["ms"]),
    "slowest / mean, time": "time_ratio:.3f",
    "goal": lambda r: "-" if r["goal"] is None else f"<= {BALANCE_GOAL} ({'met' if r['goal']['met'] else 'missed'})",
}
MEMORY_COLUMNS = {
    "cp": "cp",
    "activation MiB per rank": lambda r: mib(r["bytes"]),
    "over cp1 / cp": "ratio:.3f",
    "goal": lambda r: "-" if r["goal"] is None else f"<= {MEMORY_GOAL} ({'met' if r['goal']['met'] else 'missed'})",
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg, args = parse_config(Config, __doc__, argv)
    torch.set_num_threads(1)
    print(
        f"context_parallel: balance at seq {cfg.attention_seq}, {cfg.heads} heads of {cfg.head_dim}, fp32 on 1 thread; "
        f"GPT {cfg.layers} layers d_model {cfg.d_model} at seq {cfg.seq} (x{cfg.micro_batch}); torch {torch.__version__}",
        flush=True,
    )
    start = time.perf_counter()
    results = {"config": {**cfg.__dict__}, "balance": balance(cfg)}
    print("\n" + table(results["balance"], BALANCE_COLUMNS))
    results["memory"] = memory(cfg)
    print("\n" + table(results["memory"], MEMORY_COLUMNS))
    results["step"] = s = step(cfg)
    print(
        f"\nstep: cp 2 at {2 * cfg.seq} tokens {s['cp2_ms']:.1f} ms, cp 1 at {cfg.seq} tokens {s['cp1_ms']:.1f} ms "
        f"per forward + backward: ratio {s['ratio']:.3f} (model FLOPs per token x{s['flops_ratio']:.3f})"
    )
    results["seconds"] = time.perf_counter() - start
    numbers = [r["time_ratio"] for r in results["balance"]] + [r["ratio"] for r in results["memory"]] + [s["ratio"]]
    return finish(
        results, [] if all(x == x and abs(x) != float("inf") for x in numbers) else ["context_parallel"], args.json
    )


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
