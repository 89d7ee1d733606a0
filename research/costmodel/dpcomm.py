"""Data-parallel communication of a step: what each collective sends and where, what it
costs, and how much of it compute hides. Legend in `research.costmodel`.

Bytes per collective and rank on Ψ parameters (`dp_traffic`); N = dp_shard × cp ranks per
shard group (`Layout.shard`: context-parallel ranks hold the same parameters, so ZeRO shards
and reduces over dp × cp; the group's ranks are tp apart in the (pp, dp, cp, tp) order; k of
them per node, over n = ⌈N/k⌉ nodes), R = dp/dp_shard replicas, B = qwZ block,
q = qgZ bits/8 + 4/2048 (the fp32 scales):

    family         | when         | bytes per collective                            | passes per step
    gather_fwd     | stage 3      | PΨ(N-1)/N; qwZ: (1 + 4/B)Ψ(N-1)/N               | m forward (hpZ: 1)
    gather_bwd     | stage 3      | as gather_fwd                                   | m backward (hpZ: 0)
    gather_hpz     | stage 3, hpZ | PΨ(k-1)/k in the node, from the 1/k slices the  | m - 1 forward, m backward
                   |              |   first gather left (kept until the step)       |
    gather_step    | stages 1-2   | as gather_fwd, after the optimizer step         | 1
    reduce         | stage 0      | all-reduce 2GΨ(N-1)/N                           | 1 backward (every: m)
                   | stages 1-3   | reduce-scatter GΨ(N-1)/N; qgZ (stages 2-3): an  |
                   |              |   all-to-all of qΨ(k-1)/k in the node, then     |
                   |              |   q(Ψ/k)(n-1)/n across nodes                    |
    replicate      | R > 1        | all-reduce 2G(Ψ/N)(R-1)/R (stage 0: 2GΨ(R-1)/R) | as reduce
    tied_embedding | pp > 1, tied | all-reduce of GVh/t (its 1/N shard at stages    | 1
                   |              |   1-3) between the first and last pipeline stage|

MoE expert parameters take the same families over their own groups (`expert_layout`): a
rank holds Ψ_e/ep of them, sharded and reduced over the N/ep ranks holding the same experts
(ep·t apart), so with ep = N they need no data-parallel communication at all.

Where the bytes go (`Cluster.ring_bytes`): a ring inside a node is all NVLink; across nodes
NCCL runs k rings through k NICs, so a rank sends 1/k of it over its network share
(`Cluster.inter_node_bandwidth`) and the rest over NVLink, both at once: the slower sets the
time. qgZ's two hops run one after the other. A group of two ranks on two nodes exchanges
one message each way (a 2-rank all-gather, qgZ's hop across 2 nodes): its network bytes move
at `Cluster.pair_bandwidth`, the network's unless the hardware file measured it. On gloo
(`Cluster.backend`: CPU runs, the emulated cluster) the all-gather is a ring too, and the
reduce-scatter an all-reduce (2GΨ(N-1)/N over 2(N-1) steps), as a shaped link counts their
bytes.

Seconds of one collective (`Traffic.seconds`), alpha-beta plus quantization kernels:

    c = max(intra / NVLink, inter / network)   (qgZ: the sum)
      + α_intra·s_intra + α_inter·s_inter      (`Cluster.latency`, per call)
      + ω                                      (`Cluster.wait`, per call; qgZ: per hop)
      + K / HBM                                (`GPU.kernel_bandwidth`: measured per quantizer, else HBM's)

ω is the wait for the group's last rank to arrive: 0 on devices of their own, measured
where the processes of an emulated cluster share a CPU's cores (inside a node, across
nodes, or two ranks on two nodes). Ranks drift apart while they compute, so a slot's calls
wait ω₀ each and the first also κ·min(w, reach) (`hardware.Wait`), w the slot's own
compute (w_s below: its gradients' backward, or the forward that a gather runs beside).

Steps s (`Cluster.ring_steps`): a ring all-gather / reduce-scatter over N ranks on n nodes
takes N-1 steps, n-1 of them between nodes; an all-reduce twice that; an all-to-all N-1.
qwZ gathers the int8 values and the fp32 scales packed in one all-gather, qgZ exchanges them
in one all-to-all per hop (k-1 steps in the node, n-1 across). Calls: one per bucket
(`research.costmodel.params`): stage 3 gathers and reduces each unit's buckets, stages 0-2
reduce (and 1-2 gather) each bucket. Kernels K (HBM bytes): qwZ quantizes the rank's shard
(reads P, writes 1 + 4/B bytes per element of Ψ/N) and dequantizes the gathered unit (the
reverse, Ψ elements): (P + 1 + 4/B)(Ψ/N + Ψ); qgZ quantizes what each hop sends and
dequantizes what arrives: (G + q)·2Ψ in the node, (G + q)·2Ψ/k across. They run between a
collective's transfers and are counted in its time; that they slow the compute they run
beside is not counted.

Overlap. A pass is one chunk's forward or backward of one micro-batch, over its slots s
(`params.Slot`: a stage-3 unit with the resident units after it, or a bucket), each with
a window of compute w_s = W·Ψ_s/Ψ (W: the rank's forward or backward compute of a
micro-batch, Ψ_s: the slot's parameters, Ψ: the rank's). Per family and pass:

    exposed = c_whole + Σ_{s ≠ whole} max(0, c_s - w_{n(s)})

Stage 3 gathers one unit ahead (`optim.stage3`'s prefetch), so a gather hides under one
unit's compute, and the first gather of a pass (forward: the chunk's first slot; backward:
its last) has nothing before it: exposed whole. A reduction starts once its unit's (or
bucket's) gradients are complete and hides under the next one's compute; the last of the
backward (the first slot) is exposed whole. So n(s), whose window hides s's collective, is
the slot before s in forward order for forward gathers and reductions and the one after it
for backward gathers (`Pass.windows`); one large bucket beside small ones is exposed nearly
whole. Under one window, the backward gather goes first, a reduction hides under what it
left, and the replica all-reduce under what both left (`_in_turn`). Reductions run in the
last backward of each chunk (grad_sync every: in every backward); stages 1-2's gather after
the step and the tied-embedding all-reduce after the last backward are exposed whole.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from functools import partial

from optim.grads import QGZ_BLOCK
from research.costmodel.hardware import Cluster, ranks_per_node
from research.costmodel.layout import DTYPE_BYTES, Layout
from research.costmodel.params import Pass, RankParams, Slot
from research.model import GPTConfig


@dataclass(frozen=True)
class Traffic:
    """One collective of one rank: bytes over NVLink (`intra`) and the network (`inter`), at
    once (a ring) or one hop after the other (`phased`: qgZ); its (in-node, cross-node) steps
    per call, α each; the HBM bytes its quantization kernels move (`kernel_bytes`); `pair`:
    its group (qgZ: its cross-node hop's) is two ranks on two nodes (`Cluster.wait`);
    `exchange`: its network part is one message each way (`Cluster.pair_bandwidth`);
    `quantizer`: whose kernels ("qwz", "qgz"; `GPU.kernel_bandwidth`)."""

    intra: float
    inter: float
    phased: bool = False
    steps: tuple[int, int] = (0, 0)
    kernel_bytes: float = 0.0
    pair: bool = False
    exchange: bool = False
    calls: int = 1
    quantizer: str = ""

    def transfer_seconds(self, cluster: Cluster) -> float:
        intra, inter = cluster.seconds(self.intra, self.inter, self.exchange)
        return intra + inter if self.phased else max(intra, inter)

    def waits(self, cluster: Cluster, calls: float, before: float = 0.0) -> float:
        """What `calls` calls in a row, after `before` seconds of compute, wait for the group's
        last rank (`Cluster.wait`; qgZ: each hop for its own group)."""
        inside, across = (s > 0 for s in self.steps)
        wait = partial(cluster.wait, calls=calls, before=before)
        if self.phased:
            return inside * wait(False) + across * wait(True, self.pair)
        return wait(across, self.pair) if inside or across else 0.0

    def latency(self, cluster: Cluster, before: float = 0.0) -> float:
        """α·steps, and the waits of its calls (`waits`)."""
        return cluster.latency(*self.steps) + self.waits(cluster, self.calls, before)

    def kernel_seconds(self, cluster: Cluster) -> float:
        return self.kernel_bytes / cluster.gpu.kernel_bandwidth(self.quantizer) * cluster.compute_share

    def seconds(self, cluster: Cluster) -> float:
        """c = transfer + α·steps + kernels (module docstring)."""
        return self.transfer_seconds(cluster) + self.latency(cluster) + self.kernel_seconds(cluster)


@dataclass(frozen=True)
class Collective:
    """One family of a step's collectives, per rank: bytes and transfer seconds over NVLink and
    over the network, seconds of latency (α·steps) and of quantization kernels, the family's
    busy time and the part of it not hidden under compute."""

    name: str
    intra_bytes: float
    inter_bytes: float
    intra_seconds: float
    inter_seconds: float
    latency: float
    kernels: float
    seconds: float
    exposed: float


def ring(cluster: Cluster, size: int, stride: int, volume: float, rounds: int = 1, calls: int = 1) -> Traffic:
    """`calls` ring collectives of `rounds` rounds (all-reduce: 2) over `size` ranks `stride`
    apart, sending `volume` bytes per rank in all."""
    intra_steps, inter_steps = cluster.ring_steps(size, stride, rounds)
    steps = (calls * intra_steps, calls * inter_steps)
    pair = size == 2 and inter_steps > 0
    return Traffic(*cluster.ring_bytes(size, stride, volume), steps=steps, pair=pair, calls=calls)


def reduce_scatter(cluster: Cluster, size: int, stride: int, volume: float) -> Traffic:
    """A reduce-scatter over `size` ranks `stride` apart, `volume` bytes per rank in a ring;
    on gloo an all-reduce (`Cluster.reduce_scatter_rounds`): twice the bytes and steps."""
    rounds = cluster.reduce_scatter_rounds()
    return ring(cluster, size, stride, rounds * volume, rounds=rounds)


def _gather(layout: Layout, cluster: Cluster, psi: float) -> Traffic:
    """The all-gather of `psi` parameters over the shard group; qwZ: int8 values and fp32
    scales (packed in one all-gather), quantized before and dequantized after."""
    N, P = layout.shard, DTYPE_BYTES[layout.precision]
    per = P if layout.qwz_block is None else 1 + 4 / layout.qwz_block
    gathered = ring(cluster, N, layout.tp, per * psi * (N - 1) / N)
    kernels = 0.0 if layout.qwz_block is None else (P + per) * (psi / N + psi)
    return dataclasses.replace(gathered, exchange=gathered.pair, kernel_bytes=kernels, quantizer="qwz")


def _qgz_reduce(layout: Layout, cluster: Cluster, psi: float) -> Traffic:
    """qgZ's reduce-scatter of `psi` gradients: an all-to-all of q-byte blocks inside the node,
    then one across nodes, values and scales packed together; every hop quantizes and dequantizes."""
    G, q = DTYPE_BYTES[layout.reduce_dtype], layout.qgz_bits / 8 + 4 / QGZ_BLOCK
    k = ranks_per_node(layout.shard, layout.tp, cluster.gpus_per_node)
    nodes = -(-layout.shard // k)
    kernels = 2 * (G + q) * (psi * (k > 1) + psi / k * (nodes > 1))
    pair = nodes == 2
    return Traffic(
        q * psi * (k - 1) / k, q * psi / k * (nodes - 1) / nodes, True, (k - 1, nodes - 1), kernels, pair, pair,
        quantizer="qgz",
    )  # fmt: skip


def dp_traffic(layout: Layout, cluster: Cluster, psi: float) -> dict[str, Traffic]:
    """`Traffic` of one collective of each data-parallel family of `layout` on `psi`
    parameters (the table in the module docstring)."""
    P, G = DTYPE_BYTES[layout.precision], DTYPE_BYTES[layout.reduce_dtype]
    N, R, t, sharded = layout.shard, layout.replicas, layout.tp, layout.sharding
    out = {}
    if sharded.parameters:
        out["gather_fwd"] = out["gather_bwd"] = _gather(layout, cluster, psi)
        if layout.hpz:
            k = ranks_per_node(N, t, cluster.gpus_per_node)
            out["gather_hpz"] = ring(cluster, k, t, P * psi * (k - 1) / k)
    elif sharded.optimizer_state:
        out["gather_step"] = _gather(layout, cluster, psi)
    if layout.qgz_bits and sharded.gradients:
        out["reduce"] = _qgz_reduce(layout, cluster, psi)
    elif sharded.optimizer_state:
        out["reduce"] = reduce_scatter(cluster, N, t, G * psi * (N - 1) / N)
    else:
        out["reduce"] = ring(cluster, N, t, 2 * G * psi * (N - 1) / N, rounds=2)
    if R > 1:
        kept = psi / N if sharded.optimizer_state else psi
        out["replicate"] = ring(cluster, R, N * t, 2 * G * kept * (R - 1) / R, rounds=2)
    return out


@dataclass(frozen=True)
class _Stream:
    """One family's collectives in a pass, one per slot: of the slot's gathered parameters
    (`gathers`) or of all of them; the one of the slot at the pass's `whole` end ("first" or
    "last" in forward order) is exposed whole. `traffic` is per parameter."""

    name: str
    traffic: Traffic
    expert_traffic: Traffic  # per MoE expert parameter (every expert): its own, smaller group
    gathers: bool
    whole: str
    per_param: float  # seconds per parameter: transfer and kernels
    per_expert: float  # likewise per expert parameter
    alpha: float  # seconds per call: α·steps
    cluster: Cluster

    @classmethod
    def of(cls, name: str, traffic: Traffic, expert: Traffic, whole: str, cluster: Cluster) -> _Stream:
        def per(x: Traffic) -> float:
            return x.transfer_seconds(cluster) + x.kernel_seconds(cluster)

        gathers = name.startswith("gather")
        alpha = cluster.latency(*traffic.steps)
        return cls(name, traffic, expert, gathers, whole, per(traffic), per(expert), alpha, cluster)

    def load(self, slot: Slot) -> tuple[int, int, int]:
        """(dense parameters, expert parameters, calls) of this stream's collective of `slot`."""
        if self.gathers:
            return slot.gathered - slot.expert_gathered, slot.expert_gathered, slot.gathers
        return slot.numel - slot.expert_numel, slot.expert_numel, slot.reductions

    def latency(self, slot: Slot, window: float) -> float:
        """α·steps and waits of this stream's calls for `slot`, its group having computed the
        slot's compute since it last met (`window` seconds per parameter)."""
        calls = self.load(slot)[2]
        return self.alpha * calls + self.traffic.waits(self.cluster, calls, window * slot.numel)

    def transfer(self, slot: Slot) -> float:
        """Seconds of this stream's transfers and kernels for `slot`."""
        dense, experts, _ = self.load(slot)
        return self.per_param * dense + self.per_expert * experts

    def seconds(self, slot: Slot, window: float) -> float:
        """Busy seconds of this stream's collective of `slot`: c_s (module docstring)."""
        return self.transfer(slot) + self.latency(slot, window)


def _in_turn(window: float, busy: list[float]) -> list[float]:
    """Exposed seconds of collectives that hide in turn under one window of compute, each
    under what those before it left: max(0, c_j - max(0, w - Σ_{i<j} c_i))."""
    exposed = []
    for c in busy:
        exposed.append(max(0.0, c - window))
        window = max(0.0, window - c)
    return exposed


def _exposed(p: Pass, window: float, streams: list[_Stream]) -> list[float]:
    """Exposed seconds per stream of one pass over `p`, compute `window` seconds per
    parameter (module docstring): under each slot's compute run the collectives of its
    neighbour on the stream's side (the next slot's forward gather or reduction, the previous
    slot's backward gather), in turn; the end slot's is exposed whole."""
    exposed = [0.0] * len(streams)
    for (before, slot, after), count in p.windows:
        neighbours = [after if s.whole == "first" else before for s in streams]
        busy = [0.0 if n is None else s.seconds(n, window) for s, n in zip(streams, neighbours)]
        for j, e in enumerate(_in_turn(window * slot.numel, busy)):
            exposed[j] += count * e
    for j, s in enumerate(streams):
        exposed[j] += s.seconds(p.first if s.whole == "first" else p.last, window)
    return exposed


def _run_pass(p: Pass, window: float, streams: list[_Stream], times: int, cluster: Cluster, tally: dict) -> None:
    """Add `times` passes over `p` to `tally`: per family [NVLink bytes, network bytes,
    latency, kernels, busy, exposed]."""
    for s, exposed in zip(streams, _exposed(p, window, streams)):
        dense, experts, _ = s.load(p.total)
        x, e, row = s.traffic, s.expert_traffic, tally.setdefault(s.name, [0.0] * 6)
        latency = sum(count * s.latency(slot, window) for (_, slot, _), count in p.windows)
        spent = (
            dense * x.intra + experts * e.intra,
            dense * x.inter + experts * e.inter,
            latency,
            dense * x.kernel_seconds(cluster) + experts * e.kernel_seconds(cluster),
        )
        for i, value in enumerate((*spent, s.transfer(p.total) + latency, exposed)):
            row[i] += times * value


def _schedule(layout: Layout, streams: dict[str, _Stream], fwd: float, bwd: float) -> list[tuple]:
    """(passes per step, compute seconds per parameter, streams) of `layout`'s step."""
    m = layout.micro_batches
    syncs = m if layout.grad_sync == "every" else 1
    reductions = [streams[n] for n in ("reduce", "replicate") if n in streams]
    if not layout.sharding.parameters:
        step = [(1, 0.0, [streams["gather_step"]])] if "gather_step" in streams else []
        return [(syncs, bwd, reductions), *step]
    if layout.hpz:
        forward = [(1, fwd, [streams["gather_fwd"]]), (m - 1, fwd, [streams["gather_hpz"]])]
    else:
        forward = [(m, fwd, [streams["gather_fwd"]])]
    backward = streams["gather_hpz_bwd" if layout.hpz else "gather_bwd"]
    return [*forward, (m - syncs, bwd, [backward]), (syncs, bwd, [backward, *reductions])]


def expert_layout(layout: Layout) -> Layout:
    """The data-parallel groups of MoE expert parameters: each expert is sharded over the N/ep
    ranks holding it, ep·t apart (and replicated as the dense parameters are); ep borrows
    ranks of dp × cp."""
    ep, ranks = layout.ep, layout.dp * layout.cp
    shard = layout.shard // ep
    return dataclasses.replace(
        layout, tp=layout.tp * ep, dp=ranks // ep, dp_shard=None if shard == ranks // ep else shard, ep=1, cp=1
    )


def dp_collectives(
    layout: Layout, cluster: Cluster, rank: RankParams, compute_f: float, compute_b: float
) -> tuple[Collective, ...]:
    """The data-parallel families of a step of `rank` with their overlap (module docstring):
    passes over its units (stage 3) or buckets (stages 0-2), forward and backward compute
    `compute_f` and `compute_b` seconds per micro-batch."""
    per_param = dp_traffic(layout, cluster, 1.0)
    per_expert = dp_traffic(expert_layout(layout), cluster, 1 / layout.ep) if layout.ep > 1 else per_param
    streams = {
        name: _Stream.of(name, x, per_expert[name], "last" if name == "gather_bwd" else "first", cluster)
        for name, x in per_param.items()
    }
    if "gather_hpz" in per_param:
        hpz = per_param["gather_hpz"]
        streams["gather_hpz_bwd"] = _Stream.of("gather_hpz", hpz, hpz, "last", cluster)
    passes = Counter(rank.unit_passes if layout.sharding.parameters else rank.bucket_passes)
    tally: dict[str, list[float]] = {}
    for times, window, used in _schedule(layout, streams, compute_f / rank.numel, compute_b / rank.numel):
        for p, alike in passes.items() if times else ():
            _run_pass(p, window, used, times * alike, cluster, tally)
    return tuple(_collective(name, row, cluster, per_param[name].exchange) for name, row in tally.items())


def _collective(name: str, row: list[float], cluster: Cluster, exchange: bool = False) -> Collective:
    """The family `name` from its tally row (`_run_pass`)."""
    intra, inter, latency, kernels, busy, exposed = row
    return Collective(name, intra, inter, *cluster.seconds(intra, inter, exchange), latency, kernels, busy, exposed)


def tied_embedding(model: GPTConfig, layout: Layout, cluster: Cluster) -> Collective | None:
    """The all-reduce of the tied embedding's gradient between the first and last pipeline
    stage ((p-1)·dp·cp·t ranks apart) after the last backward: exposed whole. It sums what each
    rank holds of the reduced gradient: GVh/t bytes, or its 1/N shard where ZeRO shards the
    optimizer state (`optim.grad_tracker`: the tie groups' all-reduce of `grad_shard`)."""
    if layout.pp == 1 or not model.tie_embeddings:
        return None
    volume = DTYPE_BYTES[layout.reduce_dtype] * model.padded_vocab / layout.tp * model.d_model
    if layout.sharding.optimizer_state:
        volume /= layout.shard
    x = ring(cluster, 2, (layout.pp - 1) * layout.dp * layout.cp * layout.tp, volume, rounds=2)
    busy = x.seconds(cluster)
    return _collective("tied_embedding", [x.intra, x.inter, x.latency(cluster), 0.0, busy, busy], cluster)
