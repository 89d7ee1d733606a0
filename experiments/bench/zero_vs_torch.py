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

import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from experiments.bench.common import batch as make_batch
from experiments.bench.common import (
    launch,
    matching_adamw,
    median,
    model_state_bytes,
    optimizer_state_tensors,
    spread_ms,
    take_turns,
)
from experiments.bench.config import TinyGPTRun, parse_config
from experiments.bench.results import finish, meets, nonfinite, paired
from experiments.bench.tables import format_table, joined, mib, ratio_columns, step_time_columns, table
from research.cli import arg

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


def goal_text(r: dict[str, Any]) -> str:
    return "-" if r["goal"] is None else f"{r['goal']} 1.0"


METHOD_COLUMNS = {
    **step_time_columns("median ms", ".1f"),
    "fwd+bwd ms": "fwd_bwd_median_ms:.1f",
    "cpu ms": "cpu_median_ms:.1f",
    "final loss": "final_loss:.6f",
    "params MiB": lambda e: mib(e["memory_rank0"]["params"]),
    "grads MiB": lambda e: mib(e["memory_rank0"]["grads"]),
    "optim MiB": lambda e: mib(e["memory_rank0"]["optim"]),
    "total MiB (rank 0)": lambda e: mib(sum(e["memory_rank0"].values())),
    "max total MiB (any rank)": lambda e: mib(e["memory_max_total"]),
}
RATIO_COLUMNS = {**ratio_columns(goal_text), "per-round ratios": joined("round_ratios")}


@dataclass
class Config(TinyGPTRun):
    world_sizes: tuple[int, ...] = arg((2, 4), "world sizes to run, one launch each")
    methods: tuple[str, ...] = arg(tuple(TORCH_METHODS), "methods to run", choices=METHODS)
    dims: tuple[int, ...] = arg(
        (), "several TinyGPT hidden sizes: the whole run once per size, then the ratios by size (overrides --dim)"
    )
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

    QUICK: ClassVar[dict[str, Any]] = TinyGPTRun.QUICK | {"micro_batch": 2}

    def quick(self) -> Config:
        return replace(super().quick(), resident_numel=min(self.resident_numel, 1024))

    def problem(self) -> str | None:
        for dim in self.dims:
            if dim % self.heads:
                return f"--dim={dim} is not divisible by --heads={self.heads}"
        return "world sizes must be >= 1" if min(self.world_sizes) < 1 else super().problem()


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
        "unit_numel": cfg.unit_numel if cfg.unit_numel is not None else cfg.block_numel(),
        "resident_numel": cfg.resident_numel,
        "find_unused_parameters": False,
    }
    return {"communication": communication, "step_backend": cfg.step_backend}


def torch_adam_kwargs(cfg: Config) -> dict[str, Any]:
    """The baselines' AdamW keywords for --torch-adam ("match": `common.matching_adamw` of
    ZeroOptimizer's step backend)."""
    if cfg.torch_adam == "match":
        return matching_adamw(cfg.step_backend)
    return {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[cfg.torch_adam]


# ---------------------------------------------------------------------------------------
# One trainer per method
# ---------------------------------------------------------------------------------------


@dataclass
class Trainer:
    """A method as a step sees it: the module a batch goes through (`forward`), the backward
    of its loss, the optimizer (`step`, `zero_grad`) and the bytes of its model states."""

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], Any]
    opt: Any
    memory: Callable[[], dict[str, int]]


def zero_trainer(model: torch.nn.Module, stage: int, cfg: Config) -> Trainer:
    from optim import ZeroOptimizer
    from optim.policies import Communication

    opts = zero_options(cfg)
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        communication=Communication(**opts["communication"]),
        step_backend=opts["step_backend"],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
    )

    def memory() -> dict[str, int]:
        b = opt.memory_breakdown()
        return {"params": b["params"], "grads": b["grads"], "optim": b["master"] + b["optimizer"]}

    return Trainer(model, opt.backward, opt, memory)


def torch_baseline(
    model: torch.nn.Module, wrapped: torch.nn.Module, opt: torch.optim.Optimizer, state_of: torch.optim.Optimizer
) -> Trainer:
    """A wrapped module (DDP / FSDP2) and a torch optimizer over the model's parameters,
    `state_of` holding the optimizer state."""

    def memory() -> dict[str, int]:
        params = list(dict.fromkeys(model.parameters()))
        grads = [p.grad for p in params]
        return model_state_bytes({"params": params, "grads": grads, "optim": optimizer_state_tensors(state_of)})

    return Trainer(wrapped, torch.Tensor.backward, opt, memory)


def deepspeed_peer(model: torch.nn.Module, stage: int, cfg: Config) -> Trainer:
    """DeepSpeed's ZeRO engine at `stage` on the model, with torch's AdamW, no clipping."""
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
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )

    def memory() -> dict[str, int]:
        params = [getattr(p, "ds_tensor", p) for p in dict.fromkeys(model.parameters())]
        zero = engine.optimizer
        masters = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(
            zero, "fp32_partitioned_groups_flat", []
        )
        return model_state_bytes(
            {
                "params": params,
                "grads": [p.grad for p in model.parameters()],
                "optim": [*masters, *optimizer_state_tensors(zero.optimizer)],
            }
        )

    return Trainer(engine, engine.backward, engine, memory)


def build(method: str, cfg: Config, mesh: Any) -> Trainer:
    model = cfg.model(cfg.seed)
    adam = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, **torch_adam_kwargs(cfg))
    if method.startswith("zero"):
        return zero_trainer(model, int(method[4:]), cfg)
    if method.startswith("ds"):
        return deepspeed_peer(model, int(method[2:]), cfg)
    if method == "ddp":
        # gradient_as_bucket_view: .grad are views of DDP's buckets (no second copy of the
        # gradients; also the faster setting), so the measured grads are the buckets.
        ddp = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), **adam)
        return torch_baseline(model, ddp, opt, opt)
    if method == "ddp_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DDP(model, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adam)
        return torch_baseline(model, ddp, opt, opt.optim)
    if method.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = method == "fsdp2_reshard"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), **adam)
        return torch_baseline(model, model, opt, opt)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


# ---------------------------------------------------------------------------------------
# What every rank runs
# ---------------------------------------------------------------------------------------


def timed_step(trainer: Trainer, idx: torch.Tensor, tgt: torch.Tensor, measure: bool) -> tuple:
    """One training step after a barrier: (loss, wall s, forward+backward wall s, CPU s, memory
    or None). The memory of model states is taken after the optimizer step, before zero_grad,
    outside the timed region."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    loss = trainer.forward(idx, tgt)
    trainer.backward(loss)
    t_fb = time.perf_counter()
    trainer.opt.step()
    c1, t1 = time.process_time(), time.perf_counter()
    memory = trainer.memory() if measure else None
    c2, t2 = time.process_time(), time.perf_counter()
    trainer.opt.zero_grad()
    c3, t3 = time.process_time(), time.perf_counter()
    return loss.detach(), (t1 - t0) + (t3 - t2), t_fb - t0, (c1 - c0) + (c3 - c2), memory


def run_rank(cfg: Config) -> dict[str, Any] | None:
    """Every round: fresh models (same seed) for every method, then `warmup + steps` steps in
    which they take turns (common.take_turns). Per method (on rank 0): the slowest rank's wall /
    forward+backward / CPU ms per timed step, the global mean loss per step of the last round
    and the per-rank memory of model states after its last step, with their summaries."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = None
    if any(m.startswith("fsdp2") for m in cfg.methods):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    total = cfg.warmup + cfg.steps
    batches = [make_batch(i, cfg.micro_batch * world, cfg.seq, cfg.vocab) for i in range(total)]
    mine = slice(rank * cfg.micro_batch, (rank + 1) * cfg.micro_batch)
    per_method: dict[str, dict[str, Any]] = {
        m: {"times_ms": [], "fwd_bwd_ms": [], "cpu_ms": [], "round_medians_ms": []} for m in cfg.methods
    }
    turns = take_turns(
        cfg.methods,
        cfg.rounds,
        total,
        lambda r: {m: build(m, cfg, mesh) for m in cfg.methods},
        lambda m, trainer, i: timed_step(trainer, batches[i][0][mine], batches[i][1][mine], measure=i == total - 1),
    )
    for steps in turns:
        methods = list(steps)
        timed = [[[s[k] for s in steps[m][cfg.warmup :]] for k in (1, 2, 3)] for m in methods]
        times = torch.tensor(timed, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per step, the slowest rank
        losses = torch.stack([torch.stack([s[0] for s in steps[m]]) for m in methods]).double()
        dist.all_reduce(losses)
        memories: list[Any] = [None] * world
        dist.all_gather_object(memories, {m: steps[m][-1][4] for m in methods})
        for j, m in enumerate(methods):
            entry, t_ms = per_method[m], (times[j] * 1e3).tolist()
            for key, values in zip(("times_ms", "fwd_bwd_ms", "cpu_ms"), t_ms):
                entry[key] += values
            entry["round_medians_ms"].append(median(t_ms[0]))
            entry["losses"] = (losses[j] / world).tolist()
            entry["memory"] = [mm[m] for mm in memories]
    if rank != 0:
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
    """Per pairing: `results.paired` of ours / theirs, the goal and whether the ratio of
    medians met it, and the ratios of the rounds' medians."""
    out = []
    for ours, theirs, goal in PAIRINGS:
        if ours in per_method and theirs in per_method:
            a, b = per_method[ours], per_method[theirs]
            r = paired(a, b)
            rounds = [x / y for x, y in zip(a["round_medians_ms"], b["round_medians_ms"])]
            out.append(
                {
                    "ours": ours,
                    "theirs": theirs,
                    **r,
                    "goal": goal,
                    "met": meets(r["ratio"], goal, 1.0),
                    "round_ratios": rounds,
                }
            )
    return out


def _auto_backend() -> str:
    from optim import fused

    return fused.pick_backend("cpu")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every world size (for each of --dims), print the tables and the goals; the results
    as --json writes them: "numel", "zero_options" and "worlds" for one model size, or per
    size under "dims" (str(dim) -> those three) for several."""
    cfg, args = parse_config(Config, __doc__, argv)
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
    methods = {
        f"{'' if len(sizes) == 1 else f'dim {d} '}world {world} {m}": e
        for d, size in sizes.items()
        for world, w in size["worlds"].items()
        for m, e in w["methods"].items()
    }
    return finish(results, nonfinite(methods, ("median_ms", "final_loss", "memory_rank0")), args.json)


def run_size(cfg: Config) -> dict[str, Any]:
    """Every world size on the model of `cfg.dim`: {"numel", "zero_options", "worlds"}."""
    opts = zero_options(cfg)
    print_setup(cfg, opts)
    worlds = {str(world): run_world(cfg, world) for world in cfg.world_sizes}
    return {"numel": cfg.numel(), "zero_options": opts, "worlds": worlds}


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
            rows.append([f"{r['ours']} / {r['theirs']}", world, goal_text(r), *cells])
    params = [f"dim {d} ({sizes[d]['numel'] / 1e6:.1f}M)" for d in dims]
    return format_table(["ours / theirs", "world", "goal", *params], rows)


def print_setup(cfg: Config, opts: dict[str, Any]) -> None:
    """The model, the steps, ZeroOptimizer's options and the baselines' settings."""
    print(
        f"zero_vs_torch: {cfg.describe()}, micro-batch {cfg.micro_batch}/rank, AdamW lr={cfg.lr} wd={cfg.weight_decay}"
    )
    print(f"  {cfg.schedule()}; gloo on CPU, 1 thread/rank; torch {torch.__version__}, {platform.machine()}")
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
    print(table(({"method": m, **e} for m, e in per_method.items()), METHOD_COLUMNS))
    print()
    print(table(rs, RATIO_COLUMNS))
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


if __name__ == "__main__":
    sys.exit(1 if main()["nonfinite"] else 0)
