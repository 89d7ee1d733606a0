"""Every valid layout of a model on a cluster, estimated, ranked and explained.

Each runnable split (tp, cp, pp, dp, v, ZeRO stage, b, recompute, SP, grad_sync, ep, and
with cp > 1 the way cp ranks attend: ring, all-to-all, hybrid) that fits takes
its fastest way of communicating over dp (`comm_variants`: hybrid sharding, ZeRO++ qwZ / hpZ /
qgZ); ties go to less memory, then to exact communication. `COMM_SCHEMES` restricts the
choice (plain ZeRO, hybrid, ZeRO++)."""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from optim.sharding import Sharding
from parallel.pipeline.schedules import validate as validate_schedule
from research.costmodel.hardware import Cluster, GiB
from research.costmodel.layout import Layout
from research.costmodel.memory import Memory, predict_memory, ring_kv_bytes
from research.costmodel.steptime import (
    StepTime,
    predict_step_time,
    predict_step_times,
    step_time_bound,
    step_time_floor,
)
from research.model import GPTConfig


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: Memory
    time: StepTime
    tflops_per_gpu: float  # model FLOPs (no recompute), as the trainer reports them
    hardware_tflops_per_gpu: float  # FLOPs executed, recomputation included (Narayanan et al.'s count)
    mfu: float


def estimate(
    model: GPTConfig,
    layout: Layout,
    seq_len: int,
    cluster: Cluster,
    memory: Memory | None = None,
    time: StepTime | None = None,
) -> Estimate:
    """Memory, step time (each unless given) and throughput of one layout."""
    memory = memory or predict_memory(model, layout, seq_len, gpus_per_node=cluster.gpus_per_node)
    time = time or predict_step_time(model, layout, seq_len, cluster)
    tokens = layout.global_batch_size * seq_len
    per_gpu = tokens / time.total / layout.gpus / 1e12
    model_flops = dataclasses.replace(model, recompute="none").flops_per_token(seq_len) * per_gpu
    hardware = dataclasses.replace(model, recompute=layout.recompute).flops_per_token(seq_len) * per_gpu
    return Estimate(layout, memory, time, model_flops, hardware, model_flops * 1e12 / cluster.gpu.peak_flops)


def prediction(e: Estimate) -> tuple[str, ...]:
    """What a plan predicts of a layout (step time, memory, bytes over the network), to nine
    significant digits: layouts with equal predictions differ in nothing the model sees."""
    network = sum(c.inter_bytes for c in e.time.collectives)
    return tuple(f"{x:.9g}" for x in (e.time.total, e.memory.total, network))


@dataclass
class Plan:
    """Fitting layouts, fastest first (all of them, or those `plan(top=...)` estimated), how
    many fit (`fits`), and the others by reason: reason -> (count, example)."""

    ranked: list[Estimate]
    rejected: dict[str, tuple[int, str]] = field(default_factory=dict)
    fits: int = 0
    _closest: dict[str, float] = field(default_factory=dict, repr=False)

    def alike(self) -> list[list[Estimate]]:
        """The ranked estimates grouped by equal `prediction`, fastest first, each group in rank order."""
        groups: dict[tuple[str, ...], list[Estimate]] = {}
        for e in self.ranked:
            groups.setdefault(prediction(e), []).append(e)
        return list(groups.values())

    def step_time_of(self, n: int) -> float:
        """The step time of the `n`-th distinct prediction (`alike`); inf while there are fewer."""
        seen = set()
        for e in self.ranked:
            seen.add(prediction(e))
            if len(seen) == n:
                return e.time.total
        return math.inf

    def reject(self, reason: str, layout: Layout, detail: str, count: int = 1, miss: float = 0.0) -> None:
        """Count `count` layouts under `reason`; the example kept is the first with the
        smallest `miss` (for memory: the bytes needed, so the example is the nearest miss)."""
        total, example = self.rejected.get(reason, (0, ""))
        if not example or miss < self._closest[reason]:
            example, self._closest[reason] = f"{layout.describe()}: {detail}", miss
        self.rejected[reason] = (total + count, example)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


QWZ_BLOCK = 2048  # the qwZ block the planner offers (ZeRO++'s)
COMM_FIELDS = ("dp_shard", "qwz_block", "hpz", "qgz_bits")


def _exact(lo: Layout) -> bool:
    return lo.qwz_block is None and not lo.hpz and lo.qgz_bits is None


COMM_SCHEMES: dict[str, Callable[[Layout], bool]] = {
    # the default: what changes no number of the run (hybrid sharding and hpZ are exact)
    "exact": lambda lo: lo.qwz_block is None and lo.qgz_bits is None,
    "any": lambda lo: True,
    "zero": lambda lo: lo.replicas == 1 and _exact(lo),
    "hybrid": lambda lo: lo.replicas > 1 and _exact(lo),
    # Wang et al. 2023's set: every switch the stage has, int4 gradients
    "zero++": lambda lo: (
        lo.replicas == 1
        and lo.qwz_block is not None
        and lo.hpz == (lo.zero == 3)
        and lo.qgz_bits == (4 if lo.zero >= 2 else None)
    ),
}


def comm_variants(layout: Layout, cluster: Cluster, **fixed: object) -> list[Layout]:
    """`layout` with each way of communicating over dp that its ZeRO stage allows and that
    could be fastest under this model: dp_shard None (all dp) or, at stages 1-3, the largest
    divisor N of dp whose shard group (N·cp ranks) fits in a node (a group across c nodes
    sends per NIC the ring bytes of all dp's, (N-1)/N of them, plus the replica all-reduce,
    with more memory; a smaller one in a node sends the same network bytes, 2GΨ·t/g per rank,
    with more memory; N = 1 is stage 0's all-reduce, but under cp a group of the cp ranks); qwZ (block `QWZ_BLOCK`) at stages 1-3;
    hpZ at stage 3 when the shard group spans nodes; qgZ int4 at stages 2-3 (int8: pin
    it). `fixed` pins any of `COMM_FIELDS` to any value."""
    sharded, dp, tp, g, cp = layout.sharding, layout.dp, layout.tp, cluster.gpus_per_node, layout.cp
    smallest = 1 if cp > 1 else 2  # a shard group of the cp ranks alone (dp_shard = 1) under cp
    node = max(
        (n for n in _divisors(dp) if smallest <= n < dp and n * cp * tp <= g and n * cp % layout.ep == 0), default=None
    )
    offered = {
        "dp_shard": [None, node] if node and sharded.optimizer_state else [None],
        "qwz_block": [None, QWZ_BLOCK] if sharded.optimizer_state else [None],
        "qgz_bits": [None, 4] if sharded.gradients else [None],
    }
    values = {**offered, **{k: [None if k == "dp_shard" and fixed[k] == dp else fixed[k]] for k in fixed}}
    return [
        layout.but(dp_shard=n, qwz_block=b, hpz=h, qgz_bits=q)
        for n in values["dp_shard"]
        for h in values.get("hpz", [False, True] if sharded.parameters and (n or dp) * cp * tp > g else [False])
        for b in values["qwz_block"]
        for q in values["qgz_bits"]
    ]


def candidate_layouts(
    model: GPTConfig,
    cluster: Cluster,
    global_batch_size: int,
    seq_len: int,
    max_virtual_stages: int = 8,
    max_micro_batch_size: int = 32,
    **fixed: object,
) -> Iterator[tuple[Layout, tuple[str, str] | None, int]]:
    """Every (tp, cp, pp, dp, v, zero, b, recompute, SP, grad_sync) on `cluster`, tp inside a
    node, b a divisor of `max_micro_batch_size`, interleaved 1F1B when v > 1, grad_sync
    every only where it differs (ZeRO 2-3 with m > 1): (layout, None, 1) when it can run,
    else (layout, (reason, detail), n), where a split (tp, cp, pp, v, b) that cannot run stands
    for all n of its ZeRO / recompute / SP / grad_sync / ep variants. With MoE blocks ep runs
    over the divisors of dp × cp that divide the experts. cp runs over the divisors of
    gpus/tp that leave each rank at least `CP_MIN_TOKENS` of a sequence (`cp_choices`); a
    layout with cp > 1 comes in the first mode of `cp_variants` (the least memory; `plan`
    tries every mode as it tries every way of communicating over dp). `fixed` pins Layout
    fields, e.g. tp=8, zero=0, cp=2 (a pinned cp is searched whatever the sequence), and sets
    `attention` and `fp8`."""
    pinnable = {
        *("tp", "cp", "cp_mode", "cp_a2a", "pp", "ep", "virtual_stages", "micro_batch_size"),
        *("zero", "recompute", "sequence_parallel", "grad_sync"),
    }
    kernel = {k: fixed.pop(k) for k in ("attention", "fp8") if k in fixed}  # set, not searched
    unknown = set(fixed) - pinnable
    if unknown:
        raise TypeError(f"cannot pin {', '.join(sorted(unknown))}: the planner chooses {', '.join(sorted(pinnable))}")

    def choices(name: str, values: list) -> list:
        return _pinned(fixed, name, values)

    for tp, cp, pp, (mode, a, cp_why) in _splits(model, cluster, seq_len, fixed):
        variants = [
            (zero, recompute, sp)
            for zero in choices("zero", [0, 1, 2, 3])
            for recompute in choices("recompute", ["none", "selective", "full"])
            for sp in choices("sequence_parallel", [False, True] if tp > 1 else [False])
        ]
        dp, kind = cluster.gpus // (tp * cp * pp), {"cp": cp, "cp_mode": mode, "cp_a2a": a, **kernel}
        experts = model.moe_experts
        eps = choices("ep", [e for e in _divisors(dp * cp) if experts % e == 0] if experts else [1])
        for v, mbs in itertools.product(
            choices("virtual_stages", list(range(1, (max_virtual_stages if pp > 1 else 1) + 1))),
            choices("micro_batch_size", _divisors(max_micro_batch_size)),
        ):
            m = max(1, global_batch_size // (dp * mbs))
            name = "interleaved-1f1b" if v > 1 else "1f1b"
            why = _why_invalid(model, tp, pp, dp, v, mbs, m, name, global_batch_size) or cp_why
            if why is not None and variants and eps:
                count = len(eps) * sum(len(choices("grad_sync", _grad_syncs(z, m))) for z, _, _ in variants)
                first = Layout(tp, pp, dp, variants[0][0], v, name, mbs, m, *variants[0][1:], **kind)
                yield first, why, count
                continue
            for (zero, recompute, sp), ep in itertools.product(variants, eps):
                for grad_sync in choices("grad_sync", _grad_syncs(zero, m)):
                    layout = Layout(
                        tp, pp, dp, zero, v, name, mbs, m, recompute, sp, grad_sync=grad_sync, ep=ep, **kind
                    )
                    yield layout, _sp_problem(layout, seq_len), 1


def _pinned(fixed: dict, name: str, values: list) -> list:
    """`values` of a Layout field, or those equal to its pinned value in `fixed`."""
    return [x for x in values if x == fixed[name]] if name in fixed else values


def _splits(
    model: GPTConfig, cluster: Cluster, seq_len: int, fixed: dict
) -> Iterator[tuple[int, int, int, tuple[str, int | None, tuple[str, str] | None]]]:
    """(tp, cp, pp, `_cp_split`) of each way of splitting the cluster's GPUs: tp a divisor of
    a node's, cp of the rest among `cp_choices` (any divisor when `fixed` pins cp), pp of
    what is left; `fixed` pins any of them."""
    gpus = cluster.gpus
    for tp in _pinned(fixed, "tp", [k for k in _divisors(min(gpus, cluster.gpus_per_node)) if gpus % k == 0]):
        cps = _divisors(gpus // tp) if "cp" in fixed else cp_choices(gpus // tp, seq_len)
        for cp in _pinned(fixed, "cp", cps):
            attend = _cp_split(model, tp, cp, seq_len, cluster, fixed)
            for pp in _pinned(fixed, "pp", _divisors(gpus // (tp * cp))):
                yield tp, cp, pp, attend


# The least of a sequence that the search gives each context-parallel rank: below it a ring
# step's attention block (∝ (s/cp)²) no longer hides its K/V transfer (∝ s/cp) even over NVLink
# (s/cp ≳ η·peak/bandwidth per byte, about 1.4K tokens on an H100), and sequences that short
# fit without splitting them. A pinned cp (`plan(cp=...)`, `--cp`) is searched whatever the length.
CP_MIN_TOKENS = 4096
CP_MODES = ("ring", "all-to-all", "hybrid")


def cp_choices(ranks: int, seq_len: int) -> list[int]:
    """The cp searched among `ranks` (gpus / tp): 1, and each divisor that leaves every rank at
    least `CP_MIN_TOKENS` tokens of a sequence."""
    return [c for c in _divisors(ranks) if c == 1 or seq_len >= c * CP_MIN_TOKENS]


def cp_modes(cp: int, node: int, fixed: dict | None = None) -> list[tuple[str, int | None]]:
    """(cp_mode, cp_a2a) searched at `cp` with `node` of its ranks on a node: all-to-all (first:
    it holds no K/V block in flight, the least memory), ring, and hybrid where the cp group
    spans nodes, all-to-all among a node's cp ranks and the ring across nodes (cp_a2a =
    `node`); with the mode or cp_a2a pinned (`fixed`), hybrid with every divisor
    1 < cp_a2a < cp. ("ring", None) alone at cp = 1 (no mode to choose)."""
    if cp == 1:
        return [("ring", None)]
    fixed = fixed or {}
    mode, a2a = fixed.get("cp_mode"), fixed.get("cp_a2a")
    pinned = mode == "hybrid" or "cp_a2a" in fixed
    groups = [a for a in _divisors(cp) if 1 < a < cp and (pinned or a == node)]
    modes = [("all-to-all", None), ("ring", None), *(("hybrid", a) for a in groups)]
    kept = [(m, a) for m, a in modes if mode in (None, m) and ("cp_a2a" not in fixed or a == a2a)]
    return kept or [(mode or "hybrid", a2a)]  # pinned to what cannot run: `_cp_problem` says why


def _cp_split(
    model: GPTConfig, tp: int, cp: int, seq_len: int, cluster: Cluster, fixed: dict
) -> tuple[str, int | None, tuple[str, str] | None]:
    """(cp_mode, cp_a2a, None) of the first mode of `cp_modes` that can run, or the first mode
    and (reason, detail) why it cannot when none can."""
    modes = cp_modes(cp, cluster.gpus_per_node // tp, fixed)
    problems = [_cp_problem(model, tp, cp, mode, a, seq_len) for mode, a in modes]
    mode, a = next((m for m, why in zip(modes, problems) if why is None), modes[0])
    return mode, a, None if None in problems else problems[0]


def cp_variants(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster, **fixed: object) -> list[Layout]:
    """`layout` in each way of attending over its cp ranks (`cp_modes`, `fixed` pinning
    cp_mode or cp_a2a) that can run, in `cp_modes`' order; `layout` alone at cp = 1."""
    if layout.cp == 1:
        return [layout]
    modes = cp_modes(layout.cp, cluster.gpus_per_node // layout.tp, fixed)
    return [
        layout.but(cp_mode=mode, cp_a2a=a)
        for mode, a in modes
        if _cp_problem(model, layout.tp, layout.cp, mode, a, seq_len) is None
    ]


def _cp_problem(model: GPTConfig, tp: int, cp: int, mode: str, a: int | None, seq_len: int) -> tuple[str, str] | None:
    """(reason, detail) why context parallelism of `cp` ranks in `mode` (hybrid: all-to-all
    groups of `a`) cannot split this model's sequences over tp ranks, or None: the runtime's
    rules (`research.config.validate_context`)."""
    if mode not in CP_MODES:
        return "context parallelism attends by ring, all-to-all or hybrid", f"cp_mode={mode!r}"
    if mode == "hybrid" and (a is None or not 1 < a < cp or cp % a):
        return "hybrid context parallelism needs cp_a2a dividing cp, 1 < cp_a2a < cp", f"cp={cp}, cp_a2a={a}"
    if a is not None and mode != "hybrid":
        return "cp_a2a sizes the all-to-all groups of hybrid context parallelism", f"cp_mode={mode}, cp_a2a={a}"
    if cp == 1:
        return None
    if mode != "all-to-all" and model.dropout:
        return "ring context parallelism cannot drop attention weights", f"cp_mode={mode}, dropout={model.dropout}"
    if mode != "all-to-all" and seq_len % (2 * cp):
        return "ring context parallelism needs seq_len divisible by 2·cp", f"seq_len={seq_len}, cp={cp}"
    if mode == "all-to-all" and seq_len % cp:
        return "all-to-all context parallelism needs seq_len divisible by cp", f"seq_len={seq_len}, cp={cp}"
    heads, group = model.n_heads // tp, cp if mode == "all-to-all" else a
    if mode != "ring" and heads % group:
        name = "cp" if mode == "all-to-all" else "cp_a2a"
        return (
            f"{mode} context parallelism needs the heads per TP rank divisible by {name}",
            f"n_heads={model.n_heads}, tp={tp}: {heads} heads per rank, {name}={group}",
        )
    return None


def _sp_problem(layout: Layout, seq_len: int) -> tuple[str, str] | None:
    """(reason, detail) why sequence parallelism cannot run this layout, or None (under cp it
    splits each rank's s/cp tokens)."""
    if layout.sp and layout.cp > 1 and seq_len % (layout.tp * layout.cp):
        return (
            "sequence parallelism needs seq_len divisible by tp × cp",
            f"seq_len={seq_len}, tp={layout.tp}, cp={layout.cp}",
        )
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


def _why_comm_invalid(layout: Layout, experts: bool) -> tuple[str, str] | None:
    """(reason, detail) why the runtime refuses this hybrid sharding / ZeRO++ choice (of a
    model with `experts`), or None."""
    lo, sharded = layout, layout.sharding
    if lo.dp % (lo.dp_shard or lo.dp):
        return "dp_shard does not divide dp", f"dp={lo.dp}, dp_shard={lo.dp_shard}"
    if lo.shard % lo.ep:
        return "ep does not divide the shard group", f"dp_shard={lo.shard}, ep={lo.ep}"
    if experts and (lo.hpz or lo.qgz_bits is not None):
        return "hpZ and qgZ do not split expert parameters by node", f"hpz={lo.hpz}, qgz_bits={lo.qgz_bits}"
    if lo.qwz_block is not None and not sharded.optimizer_state:
        return "qwZ quantizes ZeRO's parameter all-gather: stages 1-3", f"zero={lo.zero}"
    if lo.hpz and not sharded.parameters:
        return "hpZ partitions ZeRO-3's gathered parameters: stage 3", f"zero={lo.zero}"
    if lo.qgz_bits is not None and not sharded.gradients:
        return "qgZ reduces sharded gradients: stages 2-3", f"zero={lo.zero}"
    if lo.qgz_bits not in (None, 4, 8):
        return "qgZ quantizes gradients to 4 or 8 bits", f"qgz_bits={lo.qgz_bits}"
    return None


def layout_problem(model: GPTConfig, layout: Layout, seq_len: int) -> str | None:
    """Why the runtime cannot run `layout` for `model` (the reasons `plan` rejects layouts
    for, short of memory), or None."""
    lo = layout
    why = _why_invalid(
        model, lo.tp, lo.pp, lo.dp, lo.virtual_stages, lo.micro_batch_size, lo.micro_batches, lo.schedule,
        lo.global_batch_size,
    )  # fmt: skip
    why = why or _cp_problem(model, lo.tp, lo.cp, lo.cp_mode, lo.cp_a2a, seq_len)
    why = why or _sp_problem(lo, seq_len) or _why_comm_invalid(lo, bool(model.moe_experts))
    return None if why is None else f"{why[0]} ({why[1]})"


def _rank_key(lo: Layout, time: StepTime, memory: Memory) -> tuple:
    """Faster first, then less memory, a lower stage, exact communication."""
    return (time.total, memory.total, lo.zero, lo.qwz_block is not None, -(lo.qgz_bits or 16))


def _estimate_key(e: Estimate) -> tuple:
    return _rank_key(e.layout, e.time, e.memory)


def _sort_variants(
    model: GPTConfig, variants: list[Layout], memories: dict, seq_len: int, cluster: Cluster
) -> tuple[list, list, list]:
    """(fitting [(layout, memory)], invalid [(reason, detail, layout)], too big [(bytes, layout)]);
    `memories` holds Memory by (dp_shard, hpz) without a ring's K/V blocks in flight
    (`ring_kv_bytes`, added per variant): all that memory depends on among variants."""
    fitting, invalid, misses = [], [], []
    for v in variants:
        why = _why_comm_invalid(v, bool(model.moe_experts))
        if why is not None:
            invalid.append((*why, v))
            continue
        kv = ring_kv_bytes(model, seq_len, v)
        if (v.dp_shard, v.hpz) not in memories:
            memories[v.dp_shard, v.hpz] = predict_memory(model, v, seq_len, gpus_per_node=cluster.gpus_per_node).plus(
                -kv
            )
        memory = memories[v.dp_shard, v.hpz].plus(kv)
        if memory.total <= cluster.gpu.memory_bytes:
            fitting.append((v, memory))
        else:
            misses.append((memory.total, v))
    return fitting, invalid, misses


def _fitting_variants(
    model: GPTConfig,
    layout: Layout,
    memory: Memory,
    seq_len: int,
    cluster: Cluster,
    scheme: str,
    pins: dict,
    result: Plan,
) -> list[tuple[Layout, Memory]]:
    """The `comm_variants` of each of the `cp_variants` of a layout whose plain form fits
    (`memory`; the least of its cp modes') that `COMM_SCHEMES[scheme]` takes, are valid and
    fit, with their memory; none (the layout counted in `result` by reason) when there are
    none. `pins`: pinned `COMM_FIELDS`, cp_mode and cp_a2a."""
    comm = {k: v for k, v in pins.items() if k in COMM_FIELDS}
    attend = {k: v for k, v in pins.items() if k not in COMM_FIELDS}
    variants = [
        v
        for c in cp_variants(model, layout, seq_len, cluster, **attend)
        for v in comm_variants(c, cluster, **comm)
        if COMM_SCHEMES[scheme](v)
    ]
    plain = memory.plus(-ring_kv_bytes(model, seq_len, layout))
    fitting, invalid, misses = _sort_variants(model, variants, {(None, False): plain}, seq_len, cluster)
    capacity = cluster.gpu.memory_bytes
    if fitting:
        return fitting
    if misses:
        need, v = min(misses, key=lambda miss: miss[0])
        result.reject("does not fit in memory", v, f"needs {need / GiB:.2f} GiB > {capacity / GiB:.2f} GiB", miss=need)
    elif invalid:
        reason, detail, v = invalid[0]
        result.reject(reason, v, detail)
    else:
        result.reject(f"no {scheme} communication for this layout", layout, f"zero={layout.zero} dp={layout.dp}")
    return []


def _fastest(model: GPTConfig, fitting: list[tuple[Layout, Memory]], seq_len: int, cluster: Cluster) -> Estimate:
    """The fastest of a layout's fitting variants: of each cp mode's communication variants,
    the plain layout alone when it is among them (listed first) and exposes no DP
    communication (no variant can beat it: each holds at least its bytes and pays at least
    its other terms); then the fastest of the modes."""
    modes: dict[tuple, list[tuple[Layout, Memory]]] = {}
    for v, memory in fitting:
        modes.setdefault((v.cp_mode, v.cp_a2a), []).append((v, memory))
    return min((_fastest_of_mode(model, f, seq_len, cluster) for f in modes.values()), key=_estimate_key)


def _fastest_of_mode(
    model: GPTConfig, fitting: list[tuple[Layout, Memory]], seq_len: int, cluster: Cluster
) -> Estimate:
    """`_fastest` among communication variants of one layout in one cp mode."""
    plain, memory = fitting[0]
    if _exact(plain) and plain.dp_shard is None:
        time = predict_step_time(model, plain, seq_len, cluster)
        if len(fitting) == 1 or not any(c.exposed for c in time.collectives):
            return estimate(model, plain, seq_len, cluster, memory, time)
    times = predict_step_times(model, [v for v, _ in fitting], seq_len, cluster)
    time, (v, memory) = min(zip(times, fitting), key=lambda f: _rank_key(f[1][0], f[0], f[1][1]))
    return estimate(model, v, seq_len, cluster, memory, time)


def plan(
    model: GPTConfig,
    cluster: Cluster,
    global_batch_size: int,
    seq_len: int,
    comm: str = "exact",
    top: int | None = None,
    **fixed: object,
) -> Plan:
    """Every runnable layout that fits in memory, each with its fastest communication (`comm`:
    a key of `COMM_SCHEMES`), fastest first. `fixed` pins Layout fields, `COMM_FIELDS`
    included. With `top`, only the layouts that can be among the `top` fastest distinct
    predictions (`Plan.alike`) are estimated, the others only counted (`Plan.fits`): layouts
    are estimated in order of `step_time_floor` until the floor exceeds the step time of the
    `top`-th distinct prediction; what is ranked and how is as without `top`."""
    result = Plan([])
    capacity = cluster.gpu.memory_bytes
    pins = {k: fixed.pop(k) for k in COMM_FIELDS if k in fixed}
    pins |= {k: fixed[k] for k in ("cp_mode", "cp_a2a") if k in fixed}
    fitting = []
    for layout, why, count in candidate_layouts(model, cluster, global_batch_size, seq_len, **fixed):
        if why is not None:
            result.reject(why[0], layout, why[1], count)
            continue
        memory = predict_memory(model, layout, seq_len, gpus_per_node=cluster.gpus_per_node)
        if memory.total > capacity:  # every variant holds at least these bytes
            result.reject(
                "does not fit in memory",
                layout,
                f"needs {memory.total / GiB:.2f} GiB > {capacity / GiB:.2f} GiB",
                miss=memory.total,
            )
            continue
        variants = _fitting_variants(model, layout, memory, seq_len, cluster, comm, pins, result)
        if variants:
            fitting.append(variants)
    result.fits = len(fitting)
    for variants in fitting if top is None else _by_floor(model, fitting, seq_len, cluster, result, top):
        bisect.insort(result.ranked, _fastest(model, variants, seq_len, cluster), key=_estimate_key)
    return result


def _by_floor(
    model: GPTConfig, fitting: list[list[tuple[Layout, Memory]]], seq_len: int, cluster: Cluster, result: Plan, top: int
) -> Iterator[list[tuple[Layout, Memory]]]:
    """The fitting layouts (each as its variants) in order of `step_time_floor` (ties in
    enumeration order) while the floor is at most the step time of `result`'s `top`-th
    distinct prediction. Floors are found lazily: each layout waits under its
    `step_time_bound` (≤ its floor), and its floor is computed when the bound comes first."""
    heap = [(step_time_bound(model, f[0][0], seq_len, cluster), i, False) for i, f in enumerate(fitting)]
    heapq.heapify(heap)
    while heap:
        key, i, exact = heapq.heappop(heap)
        if key > result.step_time_of(top):
            return
        if exact:
            yield fitting[i]
        else:
            heapq.heappush(heap, (step_time_floor(model, [v for v, _ in fitting[i]], seq_len, cluster), i, True))
