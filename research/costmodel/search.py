"""Every valid layout of a model on a cluster, estimated, ranked and explained."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

from optim.sharding import Sharding
from parallel.pipeline.schedules import validate as validate_schedule
from research.costmodel.hardware import Cluster, GiB
from research.costmodel.layout import Layout
from research.costmodel.memory import Memory, predict_memory
from research.costmodel.steptime import StepTime, predict_step_time
from research.model import GPTConfig


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: Memory
    time: StepTime
    tflops_per_gpu: float  # model FLOPs (no recompute), as the trainer reports them
    hardware_tflops_per_gpu: float  # FLOPs executed, recomputation included (Narayanan et al.'s count)
    mfu: float


def estimate(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster) -> Estimate:
    """Memory, step time and throughput of one layout."""
    memory = predict_memory(model, layout, seq_len)
    time = predict_step_time(model, layout, seq_len, cluster)
    tokens = layout.global_batch_size * seq_len
    per_gpu = tokens / time.total / layout.gpus / 1e12
    model_flops = dataclasses.replace(model, recompute="none").flops_per_token(seq_len) * per_gpu
    hardware = dataclasses.replace(model, recompute=layout.recompute).flops_per_token(seq_len) * per_gpu
    return Estimate(layout, memory, time, model_flops, hardware, model_flops * 1e12 / cluster.gpu.peak_flops)


@dataclass
class Plan:
    """Fitting layouts, fastest first, and the others by reason: reason -> (count, example)."""

    ranked: list[Estimate]
    rejected: dict[str, tuple[int, str]] = field(default_factory=dict)
    _closest: dict[str, float] = field(default_factory=dict, repr=False)

    def reject(self, reason: str, layout: Layout, detail: str, count: int = 1, miss: float = 0.0) -> None:
        """Count `count` layouts under `reason`; the example kept is the first with the
        smallest `miss` (for memory: the bytes needed, so the example is the nearest miss)."""
        total, example = self.rejected.get(reason, (0, ""))
        if not example or miss < self._closest[reason]:
            example, self._closest[reason] = f"{layout.describe()}: {detail}", miss
        self.rejected[reason] = (total + count, example)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(
    model: GPTConfig,
    cluster: Cluster,
    global_batch_size: int,
    seq_len: int,
    max_virtual_stages: int = 8,
    max_micro_batch_size: int = 32,
    **fixed: object,
) -> Iterator[tuple[Layout, tuple[str, str] | None, int]]:
    """Every (tp, pp, dp, v, zero, b, recompute, SP, grad_sync) on `cluster`, tp inside a
    node, b a divisor of `max_micro_batch_size`, interleaved 1F1B when v > 1, grad_sync
    every only where it differs (ZeRO 2-3 with m > 1): (layout, None, 1) when it can run,
    else (layout, (reason, detail), n), where a split (tp, pp, v, b) that cannot run stands
    for all n of its ZeRO / recompute / SP / grad_sync variants. `fixed` pins Layout fields, e.g. tp=8, zero=0."""
    pinnable = {"tp", "pp", "virtual_stages", "micro_batch_size", "zero", "recompute", "sequence_parallel", "grad_sync"}
    unknown = set(fixed) - pinnable
    if unknown:
        raise TypeError(f"cannot pin {', '.join(sorted(unknown))}: the planner chooses {', '.join(sorted(pinnable))}")

    def choices(name: str, values: list) -> list:
        return [x for x in values if x == fixed[name]] if name in fixed else values

    gpus = cluster.gpus
    for tp in choices("tp", [k for k in _divisors(min(gpus, cluster.gpus_per_node)) if gpus % k == 0]):
        variants = [
            (zero, recompute, sp)
            for zero in choices("zero", [0, 1, 2, 3])
            for recompute in choices("recompute", ["none", "selective", "full"])
            for sp in choices("sequence_parallel", [False, True] if tp > 1 else [False])
        ]
        for pp in choices("pp", _divisors(gpus // tp)):
            dp = gpus // (tp * pp)
            for v in choices("virtual_stages", list(range(1, (max_virtual_stages if pp > 1 else 1) + 1))):
                for mbs in choices("micro_batch_size", _divisors(max_micro_batch_size)):
                    m = max(1, global_batch_size // (dp * mbs))
                    name = "interleaved-1f1b" if v > 1 else "1f1b"
                    why = _why_invalid(model, tp, pp, dp, v, mbs, m, name, global_batch_size)
                    if why is not None and variants:
                        count = sum(len(choices("grad_sync", _grad_syncs(zero, m))) for zero, _, _ in variants)
                        yield Layout(tp, pp, dp, variants[0][0], v, name, mbs, m, *variants[0][1:]), why, count
                        continue
                    for zero, recompute, sp in variants:
                        for grad_sync in choices("grad_sync", _grad_syncs(zero, m)):
                            layout = Layout(tp, pp, dp, zero, v, name, mbs, m, recompute, sp, grad_sync=grad_sync)
                            yield layout, _sp_problem(layout, seq_len), 1


def _sp_problem(layout: Layout, seq_len: int) -> tuple[str, str] | None:
    """(reason, detail) why sequence parallelism cannot run this layout, or None."""
    if layout.sp and seq_len % layout.tp:
        return "sequence parallelism needs seq_len divisible by tp", f"seq_len={seq_len}, tp={layout.tp}"
    return None


def _grad_syncs(zero: int, m: int) -> list[str]:
    """The gradient-sync policies worth trying: they differ only at ZeRO 2-3 with m > 1."""
    return ["last", "every"] if Sharding.of_zero_stage(zero).gradients and m > 1 else ["last"]


def _why_invalid(
    model: GPTConfig, tp: int, pp: int, dp: int, v: int, mbs: int, m: int, schedule_name: str, global_batch_size: int
) -> tuple[str, str] | None:
    """(reason, detail) why this split cannot run the model and batch, or None."""
    try:
        model.validate_tp(tp)
    except ValueError as e:
        return "tp does not divide the model", str(e)
    if global_batch_size % (dp * mbs):
        return "global batch not divisible by dp × micro-batch size", f"{global_batch_size} % ({dp} × {mbs}) != 0"
    if model.n_layers % (pp * v):
        return "layers do not split evenly into pp × v stages", f"{model.n_layers} layers, {pp} × {v} stages"
    try:
        validate_schedule(schedule_name, pp, m, v)
    except ValueError as e:
        return "too few micro-batches for the schedule", str(e)
    return None


def plan(model: GPTConfig, cluster: Cluster, global_batch_size: int, seq_len: int, **fixed: object) -> Plan:
    """Estimate every runnable layout; keep those that fit in memory, fastest first."""
    result = Plan([])
    capacity = cluster.gpu.memory_bytes
    for layout, why, count in candidate_layouts(model, cluster, global_batch_size, seq_len, **fixed):
        if why is not None:
            result.reject(why[0], layout, why[1], count)
            continue
        memory = predict_memory(model, layout, seq_len)
        if memory.total > capacity:
            result.reject(
                "does not fit in memory",
                layout,
                f"needs {memory.total / GiB:.2f} GiB > {capacity / GiB:.2f} GiB",
                miss=memory.total,
            )
            continue
        result.ranked.append(estimate(model, layout, seq_len, cluster))
    result.ranked.sort(key=lambda e: (e.time.total, e.memory.total, e.layout.zero))
    return result
