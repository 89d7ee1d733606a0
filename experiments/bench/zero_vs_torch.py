"""ZeroOptimizer stages 0-3 against PyTorch's own data-parallel training, side by side.

Run (CPU, gloo; it starts its own rank processes, no torchrun needed):

    python -m experiments.bench.zero_vs_torch                          # 2 and 4 ranks
    python -m experiments.bench.zero_vs_torch --quick --world-sizes 2  # tiny smoke run
    python -m experiments.bench.zero_vs_torch --json results.json      # also write the numbers
    python -m experiments.bench.zero_vs_torch --world-sizes 2 --dims 128 256 512 1024  # by model size

Methods, all training the same seeded TinyGPT (experiments/bench/common.py) on the same
global batches with AdamW (--lr, --weight-decay on every parameter), fp32:

    zero0..zero3        optim.ZeroOptimizer(model, torch.optim.AdamW, stage=s, ...)
    ddp                 DistributedDataParallel + torch.optim.AdamW
    ddp_zero            DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    fsdp2_reshard       fully_shard per block and on the root, reshard_after_forward=True
    fsdp2_noreshard     the same with reshard_after_forward=False
    ds1..ds3            DeepSpeed's ZeRO engine, stage s (an optional peer: `--methods ... ds1 ds2 ds3`
                        with `pip install deepspeed`), on the CPU accelerator with torch's AdamW
                        ("torch_adam") and gradient clipping off (DeepSpeed's default clips at 1.0)

The baselines' AdamW uses the same kernel family as ZeroOptimizer's step backend
(`--torch-adam match`: torch_fused -> AdamW(fused=True), torch -> AdamW(foreach=True)), so
the comparison is about the data-parallel machinery, not about the Adam kernel;
`--torch-adam default` gives torch's own default instead.

Each world size is one launch of `world` gloo processes (torch.set_num_threads(1) each).
The machine is assumed noisy, so methods are interleaved step by step: each round builds
a fresh model (same seed) and optimizer for every method, then runs `--warmup` untimed and
`--steps` timed steps in which the methods take turns (the order rotates every step).
A step is forward + backward + optimizer step + zero_grad, started after a barrier; its
time is the slowest rank's. Per method the table shows the median (and quartiles) over
all timed steps of all rounds, the median forward+backward time and the median CPU time
(process time of the slowest rank: insensitive to waiting), and the global mean training
loss of the last step (the same for every method up to fp32 rounding). Model-state memory
per rank is measured after the last optimizer step (before zero_grad) from the tensors
that exist, each storage once: ZeroOptimizer.memory_breakdown() for ours (master +
optimizer reported as "optim"), params / .grad / optimizer.state for the baselines (local
shards of FSDP2's DTensors; DDP's grads are views of its buckets, so the buckets count).

Ratios are ours / theirs (< 1: ours is faster): the ratio of the median step times, on
which the goals are judged, and the median (quartiles) of the paired per-step ratios
(the two steps ran back to back, so they saw the same load). Goals: zero0 / ddp <= 1.0,
zero1 / ddp_zero < 1.0, zero3 / fsdp2_* < 1.0, zeroS / dsS < 1.0 (zero2 / ddp_zero is reported
only). DeepSpeed's model-state memory counts what exists after its step: parameters (their
ZeRO-3 partitions), gradients still held, its fp32 partitions and the AdamW state.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from experiments.bench.common import batch as make_batch
from experiments.bench.common import (
    bench_parser,
    finish,
    format_table,
    launch,
    make_model,
    median,
    mib,
    model_state_bytes,
    optimizer_state_tensors,
    percentile,
    spread_ms,
)
from research.cli import arg, config_from

TORCH_METHODS = ["zero0", "zero1", "zero2", "zero3", "ddp", "ddp_zero", "fsdp2_reshard", "fsdp2_noreshard"]
DEEPSPEED_METHODS = ["ds1", "ds2", "ds3"]
METHODS = TORCH_METHODS + DEEPSPEED_METHODS
# (ours, theirs, goal): goal "<=" means ratio <= 1.0, "<" means ratio < 1.0, None: reported only
PAIRINGS = [
    ("zero0", "ddp", "<="),
    ("zero1", "ddp_zero", "<"),
    ("zero2", "ddp_zero", None),
    ("zero3", "fsdp2_reshard", "<"),
    ("zero3", "fsdp2_noreshard", "<"),
    ("zero1", "ds1", "<"),
    ("zero2", "ds2", "<"),
    ("zero3", "ds3", "<"),
]


@dataclass
class Config:
    world_sizes: tuple[int, ...] = arg((2, 4), "world sizes to run, one launch each")
    methods: tuple[str, ...] = arg(tuple(TORCH_METHODS), "methods to run", choices=METHODS)
    steps: int = arg(10, "timed steps per method per round")
    warmup: int = arg(2, "untimed steps before them")
    rounds: int = arg(2, "rounds of fresh models; within a round the methods take turns step by step")
    dim: int = arg(256, "TinyGPT hidden size")
    dims: tuple[int, ...] = arg(
        (), "several TinyGPT hidden sizes: the whole run once per size, then the ratios by size (overrides --dim)"
    )
    layers: int = arg(4, "TinyGPT blocks")
    heads: int = arg(4, "attention heads")
    seq: int = arg(64, "tokens per sequence")
    vocab: int = arg(1024, "vocabulary size")
    micro_batch: int = arg(2, "sequences per rank per step (the global batch grows with the world size)")
    lr: float = arg(1e-3, "AdamW learning rate")
    weight_decay: float = arg(0.1, "AdamW weight decay (every parameter)")
    seed: int = arg(0, "model seed")
    bucket_numel: int | None = arg(
        None, "ZeroOptimizer bucket_numel (None: its default, optim.policies.Communication.bucket_numel)"
    )
    unit_numel: int | None = arg(None, "ZeroOptimizer unit_numel (None: one transformer block's numel)")
    resident_numel: int = arg(
        2**16,
        "ZeroOptimizer resident_numel: stage-3 units smaller than this stay gathered; fixed here so that "
        "runs compare (ZeroOptimizer's own default is unit_numel // 16); --quick lowers it",
    )
    step_backend: str | None = arg(None, "ZeroOptimizer step_backend (None: its auto pick)")
    torch_adam: Literal["match", "default", "foreach", "fused"] = arg(
        "match",
        "torch.optim.AdamW of the baselines; match: the kernel family of ZeroOptimizer's step backend "
        "(torch_fused -> fused=True, torch -> foreach=True); default: torch's own default",
    )

    def model_kwargs(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "vocab": self.vocab,
            "dim": self.dim,
            "layers": self.layers,
            "heads": self.heads,
            "seq": self.seq,
        }


def block_numel(cfg: Config) -> int:
    return 12 * cfg.dim * cfg.dim + 4 * cfg.dim  # qkv + proj + fc1 + fc2 weights, two LayerNorms


def zero_options(cfg: Config) -> dict[str, Any]:
    """ZeroOptimizer's options, as a JSON record ({"communication": Communication's fields,
    "step_backend"}). Gradient buckets: ZeroOptimizer's default against
    DDP's default buckets, so defaults meet defaults (other sizes measured: docs/benchmarks.md).
    Stage-3 units of one block each, the root unit holding the embeddings and the final norm:
    the same grouping as the FSDP2 wrapping. find_unused_parameters=False: the promise DDP's
    default makes (every parameter gets a gradient in every step), which the model keeps."""
    from optim.policies import DEFAULT_BUCKET_NUMEL

    communication = {
        "bucket_numel": cfg.bucket_numel if cfg.bucket_numel is not None else DEFAULT_BUCKET_NUMEL,
        "unit_numel": cfg.unit_numel if cfg.unit_numel is not None else block_numel(cfg),
        "resident_numel": cfg.resident_numel,
        "find_unused_parameters": False,
    }
    return {"communication": communication, "step_backend": cfg.step_backend}


def torch_adam_kwargs(cfg: Config) -> dict[str, Any]:
    """The baselines' AdamW implementation. "match" (default): the same kernel family as
    ZeroOptimizer's step backend (torch_fused -> fused=True, torch -> foreach=True), so that
    the comparison is about the data-parallel machinery, not about the Adam kernel."""
    choice = cfg.torch_adam
    if choice == "match":
        from optim import fused

        backend = cfg.step_backend or fused.pick_backend("cpu")
        choice = {"torch_fused": "fused", "torch": "foreach"}.get(backend, "default")
    return {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[choice]


# ---------------------------------------------------------------------------------------
# One trainer per method: forward_backward / step / zero_grad / memory
# ---------------------------------------------------------------------------------------


class Ours:
    def __init__(self, model: torch.nn.Module, stage: int, cfg: Config) -> None:
        from optim import ZeroOptimizer
        from optim.policies import Communication

        self.model = model
        opts = zero_options(cfg)
        self.opt = ZeroOptimizer(
            model,
            torch.optim.AdamW,
            stage=stage,
            communication=Communication(**opts["communication"]),
            step_backend=opts["step_backend"],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
        )

    def forward_backward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        loss = self.model(idx, tgt)
        self.opt.backward(loss)
        return loss.detach()

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def memory(self) -> dict[str, int]:
        b = self.opt.memory_breakdown()
        return {"params": b["params"], "grads": b["grads"], "optim": b["master"] + b["optimizer"]}


class TorchBaseline:
    """A wrapped module (DDP / FSDP2) and a torch optimizer over the model's parameters."""

    def __init__(
        self,
        model: torch.nn.Module,
        wrapped: torch.nn.Module,
        opt: torch.optim.Optimizer,
        state_of: torch.optim.Optimizer,
    ) -> None:
        self.model, self.wrapped, self.opt, self.state_of = model, wrapped, opt, state_of

    def forward_backward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        loss = self.wrapped(idx, tgt)
        loss.backward()
        return loss.detach()

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def memory(self) -> dict[str, int]:
        params = list(dict.fromkeys(self.model.parameters()))
        return model_state_bytes(
            {
                "params": params,
                "grads": [p.grad for p in params],
                "optim": optimizer_state_tensors(self.state_of),
            }
        )


class DeepSpeedPeer:
    """DeepSpeed's ZeRO engine at `stage` on the model, with torch's AdamW, no clipping."""

    def __init__(self, model: torch.nn.Module, stage: int, cfg: Config) -> None:
        import logging
        import os

        os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is first imported
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        adam = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "torch_adam": True, "adam_w_mode": True}
        config = {
            "train_micro_batch_size_per_gpu": cfg.micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {**adam, **torch_adam_kwargs(cfg)}},
            "steps_per_print": 2**31 - 1,
        }
        self.model = model
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
        )

    def forward_backward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        loss = self.engine(idx, tgt)
        self.engine.backward(loss)
        return loss.detach()

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def memory(self) -> dict[str, int]:
        params = [getattr(p, "ds_tensor", p) for p in dict.fromkeys(self.model.parameters())]
        zero = self.engine.optimizer
        masters = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(
            zero, "fp32_partitioned_groups_flat", []
        )
        return model_state_bytes(
            {
                "params": params,
                "grads": [p.grad for p in self.model.parameters()],
                "optim": [*masters, *optimizer_state_tensors(zero.optimizer)],
            }
        )


def build(method: str, cfg: Config, mesh: Any) -> Ours | TorchBaseline | DeepSpeedPeer:
    model = make_model(**cfg.model_kwargs())
    adam = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, **torch_adam_kwargs(cfg))
    if method.startswith("zero"):
        return Ours(model, int(method[4:]), cfg)
    if method.startswith("ds"):
        return DeepSpeedPeer(model, int(method[2:]), cfg)
    if method == "ddp":
        # gradient_as_bucket_view: .grad are views of DDP's buckets (no second copy of the
        # gradients; also the faster setting), so the measured grads are the buckets.
        ddp = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), **adam)
        return TorchBaseline(model, ddp, opt, opt)
    if method == "ddp_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DDP(model, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adam)
        return TorchBaseline(model, ddp, opt, opt.optim)
    if method.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = method == "fsdp2_reshard"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), **adam)
        return TorchBaseline(model, model, opt, opt)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


# ---------------------------------------------------------------------------------------
# What every rank runs
# ---------------------------------------------------------------------------------------


def timed_step(
    trainer: Ours | TorchBaseline | DeepSpeedPeer, idx: torch.Tensor, tgt: torch.Tensor, measure: bool
) -> tuple:
    """One training step after a barrier: (loss, wall s, forward+backward wall s, CPU s, memory
    or None). The memory of model states is taken after the optimizer step, before zero_grad,
    outside the timed region."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    loss = trainer.forward_backward(idx, tgt)
    t_fb = time.perf_counter()
    trainer.step()
    c1, t1 = time.process_time(), time.perf_counter()
    memory = trainer.memory() if measure else None
    c2, t2 = time.process_time(), time.perf_counter()
    trainer.zero_grad()
    c3, t3 = time.process_time(), time.perf_counter()
    return loss, (t1 - t0) + (t3 - t2), t_fb - t0, (c1 - c0) + (c3 - c2), memory


def run_round(cfg: Config, mesh: Any, batches: list, first: int) -> dict[str, dict[str, Any]]:
    """Fresh models (same seed) for every method, then `warmup + steps` steps in which the
    methods take turns step by step (the order rotates every step), so that every method
    sees the same machine load. Returns, on every rank, per method: the slowest rank's
    wall / forward+backward / CPU ms per timed step, the global mean loss per step and the
    per-rank memory of model states after the last step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    methods = cfg.methods
    trainers = {m: build(m, cfg, mesh) for m in methods}
    mine = slice(rank * cfg.micro_batch, (rank + 1) * cfg.micro_batch)
    rec: dict[str, dict[str, list]] = {m: {"wall": [], "fb": [], "cpu": [], "loss": []} for m in methods}
    memory: dict[str, Any] = {}
    total = cfg.warmup + cfg.steps
    for i in range(total):
        idx, tgt = batches[i][0][mine], batches[i][1][mine]
        k = (first + i) % len(methods)
        for m in methods[k:] + methods[:k]:
            loss, wall, fb, cpu, mem = timed_step(trainers[m], idx, tgt, measure=i == total - 1)
            rec[m]["loss"].append(loss)
            if mem is not None:
                memory[m] = mem
            if i >= cfg.warmup:
                rec[m]["wall"].append(wall)
                rec[m]["fb"].append(fb)
                rec[m]["cpu"].append(cpu)
    del trainers
    gc.collect()
    times = torch.tensor([[rec[m][key] for key in ("wall", "fb", "cpu")] for m in methods], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per step, the slowest rank
    losses = torch.stack([torch.stack(rec[m]["loss"]) for m in methods]).double()
    dist.all_reduce(losses)
    memories: list[Any] = [None] * world
    dist.all_gather_object(memories, memory)
    out = {}
    for j, m in enumerate(methods):
        t_ms = (times[j] * 1e3).tolist()
        out[m] = {
            "times_ms": t_ms[0],
            "fwd_bwd_ms": t_ms[1],
            "cpu_ms": t_ms[2],
            "losses": (losses[j] / world).tolist(),
            "memory": [mm[m] for mm in memories],
        }
    return out


def run_rank(cfg: Config) -> dict[str, Any] | None:
    world = dist.get_world_size()
    mesh = None
    if any(m.startswith("fsdp2") for m in cfg.methods):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    batches = [make_batch(i, cfg.micro_batch * world, cfg.seq, cfg.vocab) for i in range(cfg.warmup + cfg.steps)]
    per_method: dict[str, dict[str, Any]] = {
        m: {"times_ms": [], "fwd_bwd_ms": [], "cpu_ms": [], "round_medians_ms": []} for m in cfg.methods
    }
    for r in range(cfg.rounds):
        for method, out in run_round(cfg, mesh, batches, first=r).items():
            entry = per_method[method]
            for key in ("times_ms", "fwd_bwd_ms", "cpu_ms"):
                entry[key] += out[key]
            entry["round_medians_ms"].append(median(out["times_ms"]))
            entry["losses"] = out["losses"]
            entry["memory"] = out["memory"]
    if dist.get_rank() != 0:
        return None
    for entry in per_method.values():
        entry.update(spread_ms(entry["times_ms"]))
        entry["fwd_bwd_median_ms"] = median(entry["fwd_bwd_ms"])
        entry["cpu_median_ms"] = median(entry["cpu_ms"])
        entry["final_loss"] = entry["losses"][-1]
        entry["memory_rank0"] = entry["memory"][0]
        entry["memory_max_total"] = max(sum(m.values()) for m in entry["memory"])
    return per_method


# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------


def ratios(per_method: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per pairing: the ratio of the median step times, and the paired ratios (ours / theirs
    of the same step of the same round, run back to back) with their median and quartiles;
    the goal is judged on the ratio of medians."""
    out = []
    for ours, theirs, goal in PAIRINGS:
        if ours in per_method and theirs in per_method:
            a, b = per_method[ours], per_method[theirs]
            ratio = a["median_ms"] / b["median_ms"]
            paired = [x / y for x, y in zip(a["times_ms"], b["times_ms"])]
            met = None if goal is None else (ratio <= 1.0 if goal == "<=" else ratio < 1.0)
            out.append(
                {
                    "ours": ours,
                    "theirs": theirs,
                    "ratio": ratio,
                    "goal": goal,
                    "met": met,
                    "paired_median": median(paired),
                    "paired_p25": percentile(paired, 25),
                    "paired_p75": percentile(paired, 75),
                    "cpu_ratio": a["cpu_median_ms"] / b["cpu_median_ms"],
                    "round_ratios": [x / y for x, y in zip(a["round_medians_ms"], b["round_medians_ms"])],
                }
            )
    return out


def method_table(per_method: dict[str, dict[str, Any]]) -> str:
    rows = []
    for m, e in per_method.items():
        mem = e["memory_rank0"]
        rows.append(
            [
                m,
                f"{e['median_ms']:.1f}",
                f"{e['p25_ms']:.1f}-{e['p75_ms']:.1f}",
                f"{e['fwd_bwd_median_ms']:.1f}",
                f"{e['cpu_median_ms']:.1f}",
                f"{e['final_loss']:.6f}",
                mib(mem["params"]),
                mib(mem["grads"]),
                mib(mem["optim"]),
                mib(sum(mem.values())),
                mib(e["memory_max_total"]),
            ]
        )
    headers = [
        "method",
        "median ms",
        "p25-p75 ms",
        "fwd+bwd ms",
        "cpu ms",
        "final loss",
        "params MiB",
        "grads MiB",
        "optim MiB",
        "total MiB (rank 0)",
        "max total MiB (any rank)",
    ]
    return format_table(headers, rows)


def ratio_table(rs: list[dict[str, Any]]) -> str:
    rows = []
    for r in rs:
        goal = "-" if r["goal"] is None else f"{r['goal']} 1.0"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        rounds = " ".join(f"{x:.2f}" for x in r["round_ratios"])
        rows.append(
            [
                f"{r['ours']} / {r['theirs']}",
                f"{r['ratio']:.3f}",
                goal,
                met,
                f"{r['paired_median']:.3f} ({r['paired_p25']:.2f}-{r['paired_p75']:.2f})",
                f"{r['cpu_ratio']:.3f}",
                rounds,
            ]
        )
    return format_table(
        [
            "ours / theirs",
            "ratio of medians",
            "goal",
            "met",
            "paired median (p25-p75)",
            "cpu ratio",
            "per-round ratios",
        ],
        rows,
    )


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    p = bench_parser(Config, __doc__, "tiny model, 1 round, few steps")
    a = p.parse_args(argv)
    cfg = config_from(Config, a)
    if a.quick:
        cfg.steps, cfg.warmup, cfg.rounds = 3, 1, 1
        cfg.dim, cfg.layers, cfg.heads, cfg.seq, cfg.vocab, cfg.micro_batch = 64, 2, 2, 32, 256, 2
        cfg.resident_numel = min(cfg.resident_numel, 1024)
    for dim in cfg.dims or (cfg.dim,):
        if dim % cfg.heads:
            p.error(f"--dim={dim} is not divisible by --heads={cfg.heads}")
    if min(cfg.world_sizes) < 1 or cfg.steps < 1 or cfg.rounds < 1 or cfg.warmup < 0:
        p.error("world sizes, --steps and --rounds must be >= 1 and --warmup >= 0")
    return cfg, a


def _auto_backend() -> str:
    from optim import fused

    return fused.pick_backend("cpu")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every world size (for each of --dims), print the tables and the goals; the results
    as --json writes them: "numel", "zero_options" and "worlds" for one model size, or per
    size under "dims" (str(dim) -> those three) for several."""
    cfg, args = parse_args(argv)
    results: dict[str, Any] = {
        "config": asdict(cfg),
        "zero_step_backend": cfg.step_backend or _auto_backend(),
        "torch_adam_kwargs": torch_adam_kwargs(cfg),
        "torch": torch.__version__,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    start = time.perf_counter()
    sizes = {str(dim): run_size(replace(cfg, dim=dim, dims=())) for dim in cfg.dims or (cfg.dim,)}
    if len(sizes) == 1:
        results |= next(iter(sizes.values()))
        print_goals(results["worlds"])
    else:
        results["dims"] = sizes
        print("\n## ratios by model size (ratio of median step times, ours / theirs)\n")
        print(size_table(sizes))
        for dim, size in sizes.items():
            print_goals(size["worlds"], f"dim {dim}, ")
    results["seconds"] = time.perf_counter() - start
    print(f"total {results['seconds']:.0f} s")
    nonfinite = [f"dim {d} {m}" for d, size in sizes.items() for m in nonfinite_methods(size["worlds"])]
    return finish(results, nonfinite if len(sizes) > 1 else nonfinite_methods(results["worlds"]), args.json)


def run_size(cfg: Config) -> dict[str, Any]:
    """Every world size on the model of `cfg.dim`: {"numel", "zero_options", "worlds"}."""
    model = make_model(**cfg.model_kwargs())
    numel = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    del model
    opts = zero_options(cfg)
    print_setup(cfg, numel, opts)
    worlds = {str(world): run_world(cfg, world) for world in cfg.world_sizes}
    return {"numel": numel, "zero_options": opts, "worlds": worlds}


def size_table(sizes: dict[str, dict[str, Any]]) -> str:
    """One row per pairing and world size, one column per model size: the ratio of medians,
    with "!" where it misses its goal."""
    dims = list(sizes)
    first = sizes[dims[0]]["worlds"]
    rows = []
    for world in first:
        for i, r in enumerate(first[world]["ratios"]):
            cells = []
            for d in dims:
                x = sizes[d]["worlds"][world]["ratios"][i]
                cells.append(f"{x['ratio']:.3f}{'' if x['met'] in (None, True) else ' !'}")
            goal = "-" if r["goal"] is None else f"{r['goal']} 1.0"
            rows.append([f"{r['ours']} / {r['theirs']}", world, goal, *cells])
    params = [f"dim {d} ({sizes[d]['numel'] / 1e6:.1f}M)" for d in dims]
    return format_table(["ours / theirs", "world", "goal", *params], rows)


def print_setup(cfg: Config, numel: int, opts: dict[str, Any]) -> None:
    """The model, the steps, ZeroOptimizer's options and the baselines' settings."""
    print(
        f"zero_vs_torch: TinyGPT dim={cfg.dim} layers={cfg.layers} heads={cfg.heads} seq={cfg.seq} "
        f"vocab={cfg.vocab} ({numel:,} params, fp32), micro-batch {cfg.micro_batch}/rank, AdamW lr={cfg.lr} "
        f"wd={cfg.weight_decay}"
    )
    print(
        f"  {cfg.rounds} rounds x {cfg.warmup} warm-up + {cfg.steps} timed steps per method, interleaved; "
        f"gloo on CPU, 1 thread/rank; torch {torch.__version__}, {platform.machine()}"
    )
    backend = opts["step_backend"] or f"None (auto: {_auto_backend()})"
    print(
        f"  ZeroOptimizer options: {', '.join(f'{k}={v}' for k, v in opts['communication'].items())} "
        f"step_backend={backend}"
    )
    print(
        f"  baselines: torch.optim.AdamW {torch_adam_kwargs(cfg) or '(torch defaults)'} (--torch-adam {cfg.torch_adam}); "
        f"DDP(gradient_as_bucket_view=True), bucket_cap_mb default",
        flush=True,
    )


def run_world(cfg: Config, world: int) -> dict[str, Any]:
    """One launch of `world` ranks; prints its method and ratio tables and how closely the
    final losses agree. Returns {"methods", "ratios", "seconds", "loss_spread"}."""
    t0 = time.perf_counter()
    per_method = launch(run_rank, world, cfg)[0]
    elapsed = time.perf_counter() - t0
    rs = ratios(per_method)
    losses = [e["final_loss"] for e in per_method.values()]
    spread = max(losses) - min(losses)
    print(f"\n## world size {world}  ({elapsed:.0f} s)\n")
    print(method_table(per_method))
    print()
    print(ratio_table(rs))
    print(
        f"\nfinal losses agree to {spread:.2e} (max - min over methods; "
        f"initial loss {next(iter(per_method.values()))['losses'][0]:.6f})",
        flush=True,
    )
    return {"methods": per_method, "ratios": rs, "seconds": elapsed, "loss_spread": spread}


def print_goals(worlds: dict[str, dict[str, Any]], prefix: str = "") -> None:
    """Every pairing with a goal, per world size: its ratio of median step times and whether it met the goal."""
    print(f"\n{prefix}goals (ratio of median step times, ours / theirs):")
    for world, w in worlds.items():
        for r in w["ratios"]:
            if r["goal"] is not None:
                verdict = "met" if r["met"] else "MISSED"
                print(
                    f"  world {world}: {r['ours']} / {r['theirs']} = {r['ratio']:.3f} (goal {r['goal']} 1.0) {verdict}"
                )


def nonfinite_methods(worlds: dict[str, dict[str, Any]]) -> list[str]:
    """ "world W method" of every method with a NaN or infinite median time, final loss or memory."""
    return [
        f"world {world} {m}"
        for world, w in worlds.items()
        for m, e in w["methods"].items()
        if not all(math.isfinite(x) for x in [e["median_ms"], e["final_loss"], *e["memory_rank0"].values()])
    ]


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
