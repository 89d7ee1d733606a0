"""Step time of a layout on a cluster. Legend in `research.costmodel`.

Step time, per micro-batch on the slowest pipeline rank (the last: L/p layers + the head):

    t_f = W_f/(η·peak) + M_f/HBM + C_f + X_f          t_b likewise for the backward

- W: matmul FLOPs, `GPTConfig.forward_flops_per_token` (forward; backward 2×; full
  recompute adds a forward of the layers, selective its attention core), s·b tokens / t.
- M: memory traffic of the element-wise work (norms, softmax, GELU, dropout, residuals):
  each activation byte of the `none` count above is written once and read once per
  forward-equivalent pass (forward 1, backward 2, recompute 1 or its attention part).
  Without SP the replicated part (10sbh) is not divided by t: that is what SP saves.
- C: TP collectives, each equivalent to an all-reduce of sbh·A bytes (ring: 2(t-1)/t of it
  over the intra-node bandwidth): 2 forward and 2 backward per layer, plus 1 with full
  recompute (all-gather + reduce-scatter pairs under SP move the same bytes).
- X: pipeline p2p, one activation (sbh·A, /t under SP) sent per chunk in F and in B.
- η (`MATMUL_EFFICIENCY`): the one calibrated constant, see there.

Step = m(t_f + t_b) + bubble + exposed DP communication + optimizer step. The bubble is
(p-1)(t_f + t_b)/v for gpipe / 1f1b / interleaved-1f1b and (p-1)·max(t_f, t_b/2) for zb-h1
(W fills the cool-down): the makespan of `parallel.pipeline.simulate` under these costs.

DP communication per rank, Ψ = the rank's parameters, N = dp_shard ranks per shard group
(k of them per node, over n = ⌈N/k⌉ nodes), R = dp/N replicas, B = qwZ block, q = qgZ bits/8:

    family      | when            | bytes per collective                             | per step
    gather_fwd  | stage 3         | PΨ(N-1)/N; qwZ: (1 + 4/B)Ψ(N-1)/N                | m (hpZ: 1)
    gather_bwd  | stage 3         | as gather_fwd                                    | m (hpZ: 0)
    gather_hpz  | stage 3, hpZ    | PΨ(k-1)/k in the node, from the 1/k slices the   | 2m - 1
                |                 |   first gather left (kept until the step)        |
    gather_step | stages 1-2      | as gather_fwd, after the optimizer step          | 1
    reduce      | stage 0         | all-reduce 2GΨ(N-1)/N                            | 1 (every: m)
                | stages 1-3      | reduce-scatter GΨ(N-1)/N; qgZ (stages 2-3): an   |
                |                 |   all-to-all of (q + 4/2048)Ψ(k-1)/k in the node, |
                |                 |   then (q + 4/2048)(Ψ/k)(n-1)/n across nodes     |
    replicate   | R > 1           | all-reduce 2G(Ψ/N)(R-1)/R (stage 0: 2GΨ(R-1)/R)  | as reduce

Where the bytes go (`Cluster.ring_bytes`): a ring inside a node is all NVLink; across nodes
NCCL runs k rings through k NICs, so a rank sends 1/k of it over its network share
(`Cluster.inter_node_bandwidth`) and the rest over NVLink, both at once: the slower sets the
time. qgZ's two hops run one after the other. Overlap: gradient reductions (then the replica
all-reduce) run during the rank's last backward, so only what exceeds t_b/v is exposed;
with `grad_sync` every each of the m·v backwards reduces its chunk's 1/v under its own
t_b/v, m·max(0, reduce - t_b) exposed; stage 3's gathers are prefetched under the compute of
the forward / backward they feed, exposed where one exceeds it; stages 1-2's gather after
the step is exposed. Quantization kernels are not counted. A tied embedding on two stages is
all-reduced once (exposed). The optimizer step streams its shard's master, Adam state,
gradient and parameter through HBM. p2p across nodes uses one GPU's network share.
"""

from __future__ import annotations

from dataclasses import dataclass

from optim.grads import QGZ_BLOCK
from research.costmodel.hardware import Cluster, ranks_per_node
from research.costmodel.layout import DTYPE_BYTES, Layout
from research.costmodel.memory import layer_activation_bytes
from research.costmodel.params import rank_params
from research.model import GPTConfig

# η: the share of the 16-bit peak that a layer's GEMMs reach; the model's one calibrated
# constant. Fit once to Narayanan et al. 2021, Table 1, as a whole (tests/data/ptdp_table1.csv):
# 0.65 minimizes the largest relative error of the predicted TFLOP/s over the ten rows (8.6%;
# any value in 0.60-0.70 keeps every row within 15%). Element-wise memory traffic, pipeline
# bubbles and communication are modelled on their own, not folded into η.
MATMUL_EFFICIENCY = 0.65


def forward_flops_per_token(model: GPTConfig, seq_len: int) -> tuple[float, float, float]:
    """(layer, attention core, head) forward matmul FLOPs per token: `GPTConfig.forward_flops_per_token`."""
    return model.forward_flops_per_token(seq_len)


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends in one collective: over NVLink (`intra`) and over the network
    (`inter`), at once (a ring) or one hop after the other (`phased`: qgZ's all-to-all)."""

    intra: float
    inter: float
    phased: bool = False

    def seconds(self, cluster: Cluster) -> float:
        intra, inter = cluster.seconds(self.intra, self.inter)
        return intra + inter if self.phased else max(intra, inter)


@dataclass(frozen=True)
class Collective:
    """One family of data-parallel collectives of a step, per rank: bytes and seconds over
    NVLink and over the network, the family's busy time and the part of it not hidden."""

    name: str
    intra_bytes: float
    inter_bytes: float
    intra_seconds: float
    inter_seconds: float
    seconds: float
    exposed: float


@dataclass(frozen=True)
class StepTime:
    """Seconds per step; `forward` / `backward` are one micro-batch on the slowest rank."""

    forward: float
    backward: float
    pipeline: float  # m(t_f + t_b) + bubble
    bubble: float
    tp_comm: float  # part of pipeline: TP collectives of all micro-batches
    pp_comm: float  # part of pipeline: p2p of all micro-batches
    dp_comm: float  # exposed data-parallel (and tied-embedding) communication
    optimizer: float
    collectives: tuple[Collective, ...] = ()  # the data-parallel families (module docstring)

    @property
    def total(self) -> float:
        return self.pipeline + self.dp_comm + self.optimizer


def pipeline_bubble(schedule_name: str, pp: int, virtual_stages: int, t_forward: float, t_backward: float) -> float:
    """Idle time of a step beyond m(t_f + t_b): (p-1)(t_f + t_b)/v, or (p-1)·max(t_f, t_b/2)
    for zb-h1 (B and W halves of the backward), as `parallel.pipeline.simulate` measures it."""
    if schedule_name == "zb-h1":
        return (pp - 1) * max(t_forward, t_backward / 2)
    return (pp - 1) * (t_forward + t_backward) / virtual_stages


def dp_traffic(layout: Layout, cluster: Cluster, psi: float) -> dict[str, Traffic]:
    """`Traffic` of one collective of each data-parallel family of `layout` on a rank holding
    `psi` parameters (the table in the module docstring)."""
    P, G = DTYPE_BYTES[layout.precision], DTYPE_BYTES[layout.reduce_dtype]
    N, R, t, sharded = layout.shard, layout.replicas, layout.tp, layout.sharding
    k = ranks_per_node(N, t, cluster.gpus_per_node)
    nodes = -(-N // k)
    gathered = (1 + 4 / layout.qwz_block if layout.qwz_block else P) * psi * (N - 1) / N
    out = {}
    if sharded.parameters:
        out["gather_fwd"] = out["gather_bwd"] = Traffic(*cluster.ring_bytes(N, t, gathered))
        if layout.hpz:
            out["gather_hpz"] = Traffic(P * psi * (k - 1) / k, 0.0)
    elif sharded.optimizer_state:
        out["gather_step"] = Traffic(*cluster.ring_bytes(N, t, gathered))
    if layout.qgz_bits and sharded.gradients:
        q = layout.qgz_bits / 8 + 4 / QGZ_BLOCK
        out["reduce"] = Traffic(q * psi * (k - 1) / k, q * psi / k * (nodes - 1) / nodes, phased=True)
    else:
        out["reduce"] = Traffic(
            *cluster.ring_bytes(N, t, G * psi * (N - 1) / N * (1 if sharded.optimizer_state else 2))
        )
    if R > 1:
        kept = psi / N if sharded.optimizer_state else psi
        out["replicate"] = Traffic(*cluster.ring_bytes(R, N * t, 2 * G * kept * (R - 1) / R))
    return out


def _collective(name: str, parts: list[tuple[int, Traffic, float]], cluster: Cluster) -> Collective:
    """The family `name` from its (count, traffic, seconds of compute each hides under) parts."""
    intra = inter = seconds = exposed = 0.0
    for n, x, hide in parts:
        busy = x.seconds(cluster)
        intra, inter, seconds = intra + n * x.intra, inter + n * x.inter, seconds + n * busy
        exposed += n * max(0.0, busy - hide)
    return Collective(name, intra, inter, *cluster.seconds(intra, inter), seconds, exposed)


def dp_collectives(
    layout: Layout, cluster: Cluster, psi: float, compute_f: float, compute_b: float, t_b: float
) -> tuple[Collective, ...]:
    """The data-parallel families of a step with their overlap (module docstring): gathers
    under the forward / backward compute of their micro-batch, reductions (then the replica
    all-reduce, under what they leave) under the last backward's t_b/v, or each backward's
    t_b with `grad_sync` every."""
    traffic, m = dp_traffic(layout, cluster, psi), layout.micro_batches
    syncs, hide = (m, t_b) if layout.grad_sync == "every" else (1, t_b / layout.virtual_stages)
    uses = {  # family -> [(collectives per step, seconds of compute each hides under)]
        "gather_fwd": [(1 if layout.hpz else m, compute_f)],
        "gather_bwd": [(0 if layout.hpz else m, compute_b)],
        "gather_hpz": [(m - 1, compute_f), (m, compute_b)],
        "gather_step": [(1, 0.0)],
        "reduce": [(syncs, hide)],
        "replicate": [(syncs, max(0.0, hide - traffic["reduce"].seconds(cluster)))],
    }
    return tuple(
        _collective(name, [(n, traffic[name], h) for n, h in uses[name] if n], cluster)
        for name in uses
        if name in traffic and any(n for n, _ in uses[name])
    )


def _micro_batch(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster) -> tuple[float, ...]:
    """(compute_f, compute_b, TP comm f, TP comm b, p2p) seconds of one micro-batch on the
    last pipeline rank (the module docstring's t_f, t_b terms)."""
    gpu, s, b, h = cluster.gpu, seq_len, layout.micro_batch_size, model.d_model
    t, p, v = layout.tp, layout.pp, layout.virtual_stages
    layers, tokens = model.n_layers // p, s * b / t
    layer, core, head = model.forward_flops_per_token(s)
    recompute = {"none": 0.0, "selective": core, "full": layer}[layout.recompute]
    flops_f = (layers * layer + head) * tokens
    flops_b = 2 * flops_f + layers * recompute * tokens
    # element-wise traffic: 2 bytes moved per activation byte per forward-equivalent pass
    act = layer_activation_bytes(model, s, layout, "none")
    act_scores = act - layer_activation_bytes(model, s, layout, "selective")
    redo = {"none": 0.0, "selective": act_scores, "full": act}[layout.recompute]
    head_act = 4 * s * b * h / t * (1 + model.padded_vocab / h)
    mem_f = 2 * (layers * act + head_act)
    mem_b = 2 * (2 * layers * act + 2 * head_act + layers * redo)
    compute_f = flops_f / (MATMUL_EFFICIENCY * gpu.peak_flops) + mem_f / gpu.hbm_bandwidth
    compute_b = flops_b / (MATMUL_EFFICIENCY * gpu.peak_flops) + mem_b / gpu.hbm_bandwidth
    msg = s * b * h * DTYPE_BYTES[layout.precision]
    all_reduce = 2 * (t - 1) / t * msg / cluster.ring_bandwidth(t, 1)
    tp_f = 2 * layers * all_reduce
    tp_b = (2 + (layout.recompute == "full")) * layers * all_reduce
    p2p = 0.0
    if p > 1:
        inside = t * layout.dp * p <= cluster.gpus_per_node
        p2p = v * msg / (t if layout.sp else 1) / (gpu.intra_node_bandwidth if inside else cluster.inter_node_bandwidth)
    return compute_f, compute_b, tp_f, tp_b, p2p


def predict_step_times(model: GPTConfig, layouts: list[Layout], seq_len: int, cluster: Cluster) -> list[StepTime]:
    """Step times on `cluster` (the model in the module docstring) of layouts that differ at
    most in how dp communicates (`search.comm_variants`): the micro-batch is costed once."""
    layout = layouts[0]
    t, p, v, m = layout.tp, layout.pp, layout.virtual_stages, layout.micro_batches
    P, G = DTYPE_BYTES[layout.precision], DTYPE_BYTES[layout.reduce_dtype]
    compute_f, compute_b, tp_f, tp_b, p2p = _micro_batch(model, layout, seq_len, cluster)
    t_f, t_b = compute_f + tp_f + p2p, compute_b + tp_b + p2p
    bubble = pipeline_bubble(layout.schedule, p, v, t_f, t_b)
    pipeline = m * (t_f + t_b) + bubble
    psi = max(rank_params(model, t, p, v, r).numel for r in {0, p - 1})
    tied = (
        G * model.padded_vocab / t * model.d_model / cluster.inter_node_bandwidth
        if p > 1 and model.tie_embeddings
        else 0.0
    )
    times = []
    for lo in layouts:
        collectives = dp_collectives(lo, cluster, psi, compute_f, compute_b, t_b)
        dp = tied + sum(c.exposed for c in collectives)
        optimized = psi / (lo.shard if lo.sharding.optimizer_state else 1)
        optimizer = optimized * (2 * 12 + G + P) / cluster.gpu.hbm_bandwidth
        times.append(StepTime(t_f, t_b, pipeline, bubble, m * (tp_f + tp_b), m * 2 * p2p, dp, optimizer, collectives))
    return times


def predict_step_time(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster) -> StepTime:
    """Step time on `cluster` (the model in the module docstring)."""
    return predict_step_times(model, [layout], seq_len, cluster)[0]
