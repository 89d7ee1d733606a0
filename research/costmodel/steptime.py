"""Step time of a layout on a cluster. Legend in `research.costmodel`.

Step time, per micro-batch on the slowest pipeline rank (the last: L/p layers + the head):

    t_f = W_f/(η·peak) + M_f/HBM + C_f + X_f + E_f + K_f      t_b likewise for the backward

- W: matmul FLOPs, `GPTConfig.forward_flops_per_token` (forward; backward 2×; full
  recompute adds a forward of the layers, selective its attention core), s·b/cp tokens / t;
  an MoE layer adds `GPTConfig.moe_layer_extra_flops` (router, k experts and the shared
  ones in place of the dense MLP).
- M: memory traffic of the element-wise work (norms, softmax, GELU, dropout, residuals):
  each activation byte of the `none` count above is written once and read once per
  forward-equivalent pass (forward 1, backward 2, recompute 1 or its attention part).
  Without SP the replicated part (10sbh) is not divided by t: that is what SP saves.
- C: TP collectives, each equivalent to an all-reduce of sbh·A bytes (ring: 2(t-1)/t of it
  over the intra-node bandwidth, 2(t-1) steps of α_intra, `Cluster.latency`, and one wait
  for the group's last rank, `Cluster.wait`, 0 on devices of their own, grown by the drift
  over the pass's compute shared evenly among its calls): 2 forward
  and 2 backward per layer, plus 1 with full recompute (all-gather + reduce-scatter pairs
  under SP move the same bytes in the same steps), plus 1 backward under SP without float8:
  the QKV and MLP-up linears keep their input's sequence shard and all-gather it again for dW.
- X: pipeline p2p, one activation (sbh·A, /t under SP) sent per chunk in F and in B, one
  step of α each (α_intra inside a node, else α_inter); sent asynchronously, so a step
  waits only for the sends on the schedule's critical path (`exposed_p2p`), not in t_f, t_b.
- E: expert parallelism (ep > 1): per MoE layer two all-to-alls of the rows in F (dispatch,
  combine), two in B (four with full recompute), each A·h·R·(ep − 1)/ep bytes per rank
  (`expert_all_to_all_bytes`; R = s·b·k rows, balanced routing assumed).
- K: context parallelism (cp = c > 1, `Layout.cp_mode`): every term above is of the rank's
  T = s·b/c tokens, the attention core's FLOPs per token staying those of the whole sequence
  (the zigzag chunks balance the causal work over the ranks). A ring of r ranks (r = c; hybrid
  r = c/cp_a2a) runs r steps per layer, step 0 on the local block while the first K/V block
  is in flight (`ring_attention_seconds`):

      t_ring = t_0 + Σ_{j=1}^{r−1} max(t_j, t_kv)

  t_j = W_core/r, the rank's attention core cut into r blocks; t_kv one K/V block,
  2A·T·h/t bytes (`memory.kv_block_bytes`) with one α, over NVLink while the t·c ranks share
  a node, else the network. K adds t_ring − Σ t_j = (r−1)·max(0, t_kv − t_j); the backward
  likewise with blocks 2t_j and K/V plus the running dK/dV sums in flight at once (the sums
  in fp32, as `parallel.context` sends them: 3 t_kv's bytes at A = 2), plus the sums' last
  hop back to their owner, exposed; recompute (selective or full) runs the forward ring
  again in backward. All-to-all (a = c ranks; hybrid: a = cp_a2a, the inner
  ranks of the cp group, tp apart): per layer forward q, k, v in (one all-to-all of the three
  stacked) and the output back, 4A·T·(h/t)·(a − 1)/a bytes per rank in all, each tensor's
  A·T·(h/t)·(a − 1)/a (`cp_all_to_all_bytes`); the backward the same (twice with full
  recompute); not overlapped, costed as E's.
- η (`MATMUL_EFFICIENCY`): the one calibrated constant, see there. With float8 linear
  layers (`Layout.fp8`) the FLOPs of those large enough to gain (`GPTConfig.float8_linears`) run
  at the GPU's float8 peak, the rest at its 16-bit one.

Step = m(t_f + t_b) + bubble + exposed p2p + exposed DP communication + optimizer step. The bubble is
(p-1)(t_f + t_b)/v for gpipe / 1f1b / interleaved-1f1b and (p-1)·max(t_f, t_b/2) for zb-h1
(W fills the cool-down): the makespan of `parallel.pipeline.simulate` under these costs.

Shared compute (`Cluster.compute_share` σ > 1: the processes of an emulated cluster on fewer
CPU cores): compute runs at 1/σ while every rank computes. A pipeline's stages take turns on
the cores: `research.costmodel.sharing` simulates the schedule with processor sharing (n
stages computing at once, each `Cluster.group_share` of their processes times slower than
alone), its sends included. Without a pipeline, the t·ep ranks that meet at every TP /
expert call compute together at 1/σ_g (`group_share` of t·ep); where they span nodes a call
waits on the network and leaves the cores to the other groups, so the step takes
max(m(σ_g·compute + calls), m(σ·compute + the calls inside a host, which use the cores)).
Where the cores bound the step, every compute term (and the overlap windows, the optimizer
step, quantization kernels) is σ times one alone's.

Data-parallel communication (`research.costmodel.dpcomm`: bytes, alpha-beta latency,
quantization kernels, overlap per stage-3 unit or bucket) adds what compute does not hide,
the tied embedding's all-reduce included. The optimizer step streams its shard's master,
Adam state, gradient and parameter through HBM. p2p across nodes uses one GPU's network
share.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from parallel.pipeline.partition import layer_ranges
from parallel.pipeline.schedules import stage_of
from research.costmodel.dpcomm import Collective, dp_collectives, tied_embedding
from research.costmodel.hardware import GPU, Cluster, ranks_per_node
from research.costmodel.layout import DTYPE_BYTES, Layout
from research.costmodel.memory import kv_block_bytes, layer_activation_bytes
from research.costmodel.params import RankParams, rank_params
from research.costmodel.sharing import shared_makespan
from research.model import GPTConfig

# η: the share of the 16-bit peak that a layer's GEMMs reach; the model's one calibrated
# constant. Fit once to Narayanan et al. 2021, Table 1, as a whole (tests/data/ptdp_table1.csv):
# 0.65 minimizes, to two digits, the largest relative error of the predicted TFLOP/s over the ten rows (8.8%;
# any value in 0.60-0.70 keeps every row within 15%). Element-wise memory traffic, pipeline
# bubbles and communication are modelled on their own, not folded into η.
MATMUL_EFFICIENCY = 0.65


def forward_flops_per_token(model: GPTConfig, seq_len: int) -> tuple[float, float, float]:
    """(layer, attention core, head) forward matmul FLOPs per token: `GPTConfig.forward_flops_per_token`."""
    return model.forward_flops_per_token(seq_len)


@dataclass(frozen=True)
class StepTime:
    """Seconds per step; `forward` / `backward` are one micro-batch on the slowest rank."""

    forward: float
    backward: float
    pipeline: float  # m(t_f + t_b) + bubble + pp_comm
    bubble: float
    tp_comm: float  # part of pipeline: TP collectives of all micro-batches
    pp_comm: float  # part of pipeline: the p2p it waits for (`exposed_p2p`)
    dp_comm: float  # exposed data-parallel (and tied-embedding) communication: Σ collectives' exposed
    optimizer: float
    collectives: tuple[Collective, ...] = ()  # the data-parallel families and the tied embedding (`dpcomm`)
    ep_comm: float = 0.0  # part of pipeline: the MoE layers' all-to-alls of all micro-batches
    cp_comm: float = 0.0  # part of pipeline: context parallelism's exposed K/V ring and all-to-alls

    @property
    def total(self) -> float:
        return self.pipeline + self.dp_comm + self.optimizer


def pipeline_bubble(schedule_name: str, pp: int, virtual_stages: int, t_forward: float, t_backward: float) -> float:
    """Idle time of a step beyond m(t_f + t_b): (p-1)(t_f + t_b)/v, or (p-1)·max(t_f, t_b/2)
    for zb-h1 (B and W halves of the backward), as `parallel.pipeline.simulate` measures it."""
    if schedule_name == "zb-h1":
        return (pp - 1) * max(t_forward, t_backward / 2)
    return (pp - 1) * (t_forward + t_backward) / virtual_stages


def _micro_batch(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster) -> tuple[float, ...]:
    """(compute_f, compute_b, TP comm f, TP comm b, EP comm f, EP comm b, CP comm f, CP comm b,
    p2p) seconds of one micro-batch on the last pipeline rank (the module docstring's t_f, t_b
    terms); a rank holds T = s·b/cp of its tokens."""
    gpu, s, T, h = cluster.gpu, seq_len, layout.tokens(seq_len), model.d_model
    t, p, full = layout.tp, layout.pp, layout.recompute == "full"
    layers = model.n_layers // p
    moe = moe_layers_of_rank(model, layout, p - 1)
    flops_f, flops_b = _flops(model, layout, s, layers, moe)
    # element-wise traffic: 2 bytes moved per activation byte per forward-equivalent pass
    act, redo = _layer_traffic(model, layout, s, moe, layers)
    head_act = 4 * T * h / t * (1 + model.padded_vocab / h)
    mem_f = 2 * (act + head_act)
    mem_b = 2 * (2 * act + 2 * head_act + redo)
    rate = _matmul_rate(model, layout, gpu, s, layers, moe)
    compute_f = flops_f / rate + mem_f / gpu.hbm_bandwidth
    compute_b = flops_b / rate + mem_b / gpu.hbm_bandwidth
    msg = T * h * DTYPE_BYTES[layout.precision]
    # the bf16 column linears' inputs, gathered again in backward: two all-gathers, one all-reduce's time
    regather = (layout.sp and t > 1) * len({"qkv", "up"} - layout.float8_linears(model)) / 2
    ends_f, ends_b = _tp_ends(model, layout)
    # vocabulary-parallel cross entropy: the max, the target logit and Σ exp over the T tokens
    loss = 3 * _tp_all_reduce(4 * T, t, cluster) if t > 1 else 0.0
    # the calls of a pass share its compute: each waits for the drift of its share (`Cluster.wait`)
    share_f, share_b = cluster.compute_share * compute_f, cluster.compute_share * compute_b
    all_reduce, a2a = partial(_tp_all_reduce, msg, t, cluster), partial(expert_all_to_all, model, layout, s, cluster)
    tp_f = _calls(2 * layers + ends_f, share_f, all_reduce) + loss
    tp_b = _calls((2 + full + regather) * layers + ends_b, share_b, all_reduce)
    ep_f, ep_b = _calls(2 * moe, share_f, a2a), _calls((2 + 2 * full) * moe, share_b, a2a)
    cp_f, cp_b = context_parallel_seconds(model, layout, s, cluster, layers, share_f, share_b)
    p2p = _p2p(layout, msg / (t if layout.sp else 1), cluster)
    return compute_f, compute_b, tp_f, tp_b, ep_f, ep_b, cp_f, cp_b, p2p


def _flops(model: GPTConfig, layout: Layout, seq_len: int, layers: int, moe: int) -> tuple[float, float]:
    """(forward, backward) matmul FLOPs of one micro-batch on a rank of `layers` layers, `moe`
    of them MoE layers, and the head: the W term, s·b/cp tokens / t."""
    tokens = layout.tokens(seq_len) / layout.tp
    layer, core, head = model.forward_flops_per_token(seq_len)
    extra = moe * model.moe_layer_extra_flops() if moe else 0.0
    recompute = {"none": 0.0, "selective": layers * core, "full": layers * layer + extra}[layout.recompute]
    flops_f = (layers * layer + extra + head) * tokens
    return flops_f, 2 * flops_f + recompute * tokens


def step_time_bound(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster) -> float:
    """A quick lower bound of `step_time_floor`: the matmuls of the step's m micro-batches on the
    last pipeline rank alone, m(W_f + W_b)/(η·peak) (every other term is ≥ 0, and shared cores
    only slow compute down)."""
    layers, moe = model.n_layers // layout.pp, moe_layers_of_rank(model, layout, layout.pp - 1)
    rate = _matmul_rate(model, layout, cluster.gpu, seq_len, layers, moe)
    return layout.micro_batches * sum(_flops(model, layout, seq_len, layers, moe)) / rate


def _calls(calls: float, compute: float, seconds: Callable[[float], float]) -> float:
    """Seconds of `calls` collectives spread evenly over `compute` seconds of a pass, one call
    costing `seconds(compute before it)`."""
    return calls * seconds(compute / calls) if calls else 0.0


def _tp_all_reduce(nbytes: float, t: int, cluster: Cluster, before: float = 0.0) -> float:
    """Seconds of a ring all-reduce of `nbytes` over the t ranks of a TP group, after `before`
    seconds of compute: bytes, α per step and the wait for the group's last rank
    (`Cluster.wait`; a group of more than a node, as on an emulated cluster of one process a
    host, waits as one across nodes)."""
    if t == 1:
        return 0.0
    wait = cluster.wait(t > cluster.gpus_per_node, t == 2, 1, before)
    return 2 * (t - 1) / t * nbytes / cluster.ring_bandwidth(t, 1) + cluster.latency(2 * (t - 1), 0) + wait


def _tp_ends(model: GPTConfig, layout: Layout) -> tuple[float, float]:
    """TP communication of the model's ends on the last pipeline rank, (forward, backward) in
    all-reduces of a micro-batch's activations: the head's input (all-reduced in backward;
    under SP all-gathered, then reduce-scattered, and an untied head gathers it again for its
    weight gradient) and, where one stage holds the whole model, the embedding's output
    (all-reduced in forward; under SP reduce-scattered, then all-gathered)."""
    if layout.tp == 1:
        return 0.0, 0.0
    head = (0.5, 0.5 + 0.5 * (not model.tie_embeddings)) if layout.sp else (0.0, 1.0)
    embedding = (0.0, 0.0) if layout.pp > 1 else (0.5, 0.5) if layout.sp else (1.0, 0.0)
    return head[0] + embedding[0], head[1] + embedding[1]


def _matmul_rate(model: GPTConfig, layout: Layout, gpu: GPU, seq_len: int, layers: int, moe: int) -> float:
    """η (the GPU's measured one, else the fit) × the matmul FLOP/s of the rank's layers: the 16-bit peak, or with float8 linear
    layers the share of the FLOPs of those in float8 (of QKV, projection, dense MLPs) at the float8 peak."""
    if not layout.fp8:
        return (gpu.matmul_efficiency or MATMUL_EFFICIENCY) * gpu.peak_flops
    if gpu.fp8_flops is None:
        raise ValueError(f"the {gpu.name} has no float8 tensor cores: plan it without --fp8")
    layer, _, head = model.forward_flops_per_token(seq_len)
    cast = layout.float8_linears(model)
    flops = {n: 2 * i * o if n in cast else 0 for n, (i, o) in model.linear_shapes(1).items()}
    linear = layers * (flops["qkv"] + flops["proj"]) + (layers - moe) * (flops["up"] + flops["down"])
    total = layers * layer + (moe * model.moe_layer_extra_flops() if moe else 0.0) + head
    share = linear / total
    return (gpu.matmul_efficiency or MATMUL_EFFICIENCY) / ((1 - share) / gpu.peak_flops + share / gpu.fp8_flops)


def _layer_traffic(model: GPTConfig, layout: Layout, seq_len: int, moe: int, layers: int) -> tuple[float, float]:
    """(activation bytes of the rank's layers, bytes rewritten by recompute) per micro-batch:
    `moe` of its `layers` are MoE layers."""
    act, redo = 0.0, 0.0
    for kind, count in ((False, layers - moe), (True, moe)):
        none = layer_activation_bytes(model, seq_len, layout, "none", kind)
        scores = none - layer_activation_bytes(model, seq_len, layout, "selective", kind)  # 0 for fused attention
        act += count * none
        redo += count * {"none": 0.0, "selective": scores, "full": none}[layout.recompute]
    return act, redo


def moe_layers_of_rank(model: GPTConfig, layout: Layout, pp_rank: int) -> int:
    """MoE layers among the chunks of pipeline rank `pp_rank`."""
    if not model.moe_experts:
        return 0
    ranges = layer_ranges(model.n_layers, layout.pp * layout.virtual_stages)
    stages = (stage_of(pp_rank, c, layout.pp) for c in range(layout.virtual_stages))
    return sum(model.is_moe(i) for stage in stages for i in ranges[stage])


def expert_all_to_all_bytes(model: GPTConfig, layout: Layout, seq_len: int) -> float:
    """Bytes one rank sends in one all-to-all of an MoE layer's rows: A·h·R·(ep − 1)/ep, R = T·k
    rows (balanced routing; T = s·b/cp, the rank's tokens), or with a capacity c the
    E·⌈c·T·k/E⌉ slots it pads to (every TP rank of the group sends the group's T tokens)."""
    moe, ep = model.moe, layout.ep
    slots = layout.tokens(seq_len) * moe.top_k
    rows = slots if moe.capacity_factor is None else moe.experts * math.ceil(moe.capacity_factor * slots / moe.experts)
    return DTYPE_BYTES[layout.precision] * model.d_model * rows * (ep - 1) / ep


def expert_all_to_all(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster, before: float = 0.0) -> float:
    """Seconds of one all-to-all of an MoE layer's rows (`expert_all_to_all_bytes`), sent to
    the ep − 1 peers at once: NVLink to those on the node, the network to the rest, one α
    each (the ep ranks are tp apart), after `before` seconds of compute (`Cluster.wait`)."""
    if layout.ep == 1:
        return 0.0
    return all_to_all_seconds(cluster, expert_all_to_all_bytes(model, layout, seq_len), layout.ep, layout.tp, before)


def all_to_all_seconds(cluster: Cluster, nbytes: float, size: int, stride: int, before: float = 0.0) -> float:
    """Seconds of one all-to-all in which each of `size` ranks `stride` apart sends `nbytes` in
    all, 1/(size − 1) of it to each peer at once: NVLink to those on its node, the network to
    the rest, one α each, after `before` seconds of compute (`Cluster.wait`)."""
    if size == 1:
        return 0.0
    per_peer = nbytes / (size - 1)
    near = ranks_per_node(size, stride, cluster.gpus_per_node)
    intra, inter = cluster.seconds(per_peer * (near - 1), per_peer * (size - near))
    return (
        max(intra, inter)
        + cluster.latency(int(near > 1), int(size > near))
        + cluster.wait(size > near, size == 2, 1, before)
    )


def cp_all_to_all_bytes(model: GPTConfig, layout: Layout, seq_len: int) -> float:
    """Bytes one rank sends in context-parallel attention's all-to-alls for one tensor (q, k or v
    in, or the output back): A·T·(h/t)·(a − 1)/a over a group of a = `Layout.cp_a2a_size`
    ranks (cp for all-to-all, cp_a2a for hybrid; 0 for a ring), T = s·b/cp. q, k and v go in
    one all-to-all (3×), the output in another: 4× a layer and pass."""
    a = layout.cp_a2a_size
    return DTYPE_BYTES[layout.precision] * layout.tokens(seq_len) * model.d_model / layout.tp * (a - 1) / a


def ring_attention_seconds(blocks: Sequence[float], transfer: float) -> float:
    """Seconds of ring attention over len(blocks) steps: step 0 computes the local block while
    the first K/V transfer is in flight, and each later step j waits for its block to arrive,

        t_ring = t_block_0 + Σ_{j=1}^{n−1} max(t_block_j, t_transfer)

    (compute-bound: Σ t_block; bandwidth-bound: t_block_0 + (n − 1)·t_transfer)."""
    return blocks[0] + sum(max(block, transfer) for block in blocks[1:])


def ring_exposed_seconds(blocks: Sequence[float], transfer: float) -> float:
    """What ring attention adds to its blocks' compute: `ring_attention_seconds` − Σ t_block
    = Σ_{j=1}^{n−1} max(0, t_transfer − t_block_j)."""
    return sum(max(0.0, transfer - block) for block in blocks[1:])


def kv_transfer_seconds(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster, blocks: float = 1) -> float:
    """Seconds of one ring step's transfer of `blocks` K/V blocks' bytes (`memory.kv_block_bytes`)
    to the next rank of the ring (cp/cp_a2a ranks tp·cp_a2a apart, inside tp's node placement):
    NVLink and α_intra while the tp·cp ranks share a node, else the GPU's network share and
    α_inter (the ranks at a node's edge send across it)."""
    nbytes = blocks * kv_block_bytes(model, seq_len, layout)
    if layout.tp * layout.cp <= cluster.gpus_per_node:
        return nbytes / cluster.gpu.intra_node_bandwidth + cluster.latency(1, 0)
    return nbytes / cluster.inter_node_bandwidth + cluster.latency(0, 1)


def context_parallel_seconds(
    model: GPTConfig,
    layout: Layout,
    seq_len: int,
    cluster: Cluster,
    layers: int,
    compute_f: float = 0.0,
    compute_b: float = 0.0,
) -> tuple[float, float]:
    """(forward, backward) seconds that context parallelism adds to one micro-batch of `layers`
    layers beyond their compute (already ÷ cp), per the module docstring's K term; the
    all-to-alls' waits spread over `compute_f` / `compute_b` (`_calls`)."""
    if layout.cp == 1:
        return 0.0, 0.0
    ring_f = ring_b = 0.0
    r = layout.cp_ring_size
    if r > 1:
        core = model.forward_flops_per_token(seq_len)[1] * layout.tokens(seq_len) / layout.tp
        rate = (cluster.gpu.matmul_efficiency or MATMUL_EFFICIENCY) * cluster.gpu.peak_flops
        block, transfer = (
            cluster.compute_share * core / rate / r,
            partial(kv_transfer_seconds, model, layout, seq_len, cluster),
        )
        ring_f = ring_exposed_seconds([block] * r, transfer())
        # backward: K/V and the running dK/dV sums (fp32: `parallel.context.kernels.accumulator`)
        # in flight at once, and the sums' last hop back to their owner after the last block
        sums = max(DTYPE_BYTES[layout.precision], 4) / DTYPE_BYTES[layout.precision]
        ring_b = ring_exposed_seconds([2 * block] * r, transfer(1 + sums)) + transfer(sums)
        ring_b += ring_f if layout.recompute != "none" else 0.0  # the recomputed core runs the ring again
    a, nbytes = layout.cp_a2a_size, cp_all_to_all_bytes(model, layout, seq_len)

    def call(before: float) -> float:  # the mean of a layer's two: q, k, v stacked (3×), the output (1×)
        one = partial(all_to_all_seconds, cluster, size=a, stride=layout.tp, before=before)
        return (one(3 * nbytes) + one(nbytes)) / 2

    a2a_f = _calls(2 * layers, compute_f, call) if a > 1 else 0.0
    a2a_b = _calls(2 * (1 + (layout.recompute == "full")) * layers, compute_b, call) if a > 1 else 0.0
    return layers * ring_f + a2a_f, layers * ring_b + a2a_b


def exposed_p2p(
    schedule_name: str, pp: int, micro_batches: int, p2p: float, t_forward: float, t_backward: float
) -> float:
    """Seconds of pipeline sends on a step's critical path: the makespan of
    `parallel.pipeline.simulate` with sends of c = `p2p` seconds (a micro-batch's sends in one
    direction; one at a time on a link) less the makespan without. The executor sends
    asynchronously and receives right before the compute that needs it, so a send waits only
    where the schedule has nothing else to run. 1F1B (exact, held to the simulator by a test):

        2c(m + p − 3 − ⌊(m − 2)/p⌋)   (+ max(0, c − t_f − t_b) at p = 2, m even)

    every p micro-batches in flight wait out a round trip of 2(p − 1) hops, beyond the fill
    and drain; so the sends cost c per micro-batch at p = 2, not only 2(p − 1)c. Other
    schedules: the fill and drain's 2(p − 1) sends, and m times a send's excess over the
    compute it hides under, each direction."""
    p, m, c = pp, micro_batches, p2p
    if p == 1:
        return 0.0
    if schedule_name == "1f1b":
        tail = max(0.0, c - t_forward - t_backward) if p == 2 and m % 2 == 0 else 0.0
        return 2 * c * (m + p - 3 - (m - 2) // p) + tail
    steady = max(0.0, c - t_forward) + max(0.0, c - t_backward)
    return 2 * (p - 1) * c + m * steady


def _p2p(layout: Layout, msg: float, cluster: Cluster) -> float:
    """Seconds of a micro-batch's pipeline sends in one direction: one `msg`-byte activation
    per chunk, one step each, over NVLink when the pipeline fits in a node, else the network."""
    if layout.pp == 1:
        return 0.0
    if layout.gpus <= cluster.gpus_per_node:
        return layout.virtual_stages * (msg / cluster.gpu.intra_node_bandwidth + cluster.latency(1, 0))
    return layout.virtual_stages * (msg / cluster.inter_node_bandwidth + cluster.latency(0, 1))


def _pipeline(
    layout: Layout, cluster: Cluster, compute: tuple[float, float], calls: tuple[float, float], p2p: float
) -> tuple[float, ...]:
    """(compute_f, compute_b, t_f, t_b, bubble, exposed sends, pipeline seconds) of a step whose
    micro-batch computes `compute` alone and calls `calls` (TP, experts): compute at the rate
    the ranks get (the module docstring's "Shared compute")."""
    p, v, m, share = layout.pp, layout.virtual_stages, layout.micro_batches, cluster.compute_share
    (compute_f, compute_b), (calls_f, calls_b) = compute, calls
    # The ranks that meet at every TP / expert / context-parallel call compute together; where
    # they span nodes a call waits on the network, leaving the cores to the other groups, else
    # it uses them (ep and cp groups both run inside dp × cp, tp apart: one holds the other).
    group = layout.tp * math.lcm(layout.ep, layout.cp)
    held = float(group <= cluster.gpus_per_node)
    if share > 1 and p > 1:  # stages take turns on the cores: simulated
        per_stage = cluster.gpus // p
        pipeline = shared_makespan(
            layout.schedule, p, m, v, compute, calls, p2p, lambda n: cluster.group_share(n * per_stage), held > 0
        )
        compute_f, compute_b = share * compute_f, share * compute_b
        t_f, t_b = compute_f + held * calls_f, compute_b + held * calls_b
        return compute_f, compute_b, t_f, t_b, max(0.0, pipeline - m * (t_f + t_b)), 0.0, pipeline
    lockstep = cluster.group_share(group)
    t_f, t_b = lockstep * compute_f + calls_f, lockstep * compute_b + calls_b
    bubble = pipeline_bubble(layout.schedule, p, v, t_f, t_b)
    sends = exposed_p2p(layout.schedule, p, m, p2p, t_f, t_b)
    if m * (share * (compute_f + compute_b) + held * (calls_f + calls_b)) > m * (t_f + t_b) + bubble + sends:
        compute_f, compute_b = share * compute_f, share * compute_b  # the shared cores bound the step
        t_f, t_b, bubble, sends = compute_f + held * calls_f, compute_b + held * calls_b, 0.0, 0.0
    else:
        compute_f, compute_b = lockstep * compute_f, lockstep * compute_b
    return compute_f, compute_b, t_f, t_b, bubble, sends, m * (t_f + t_b) + bubble + sends


class _Pipelined(NamedTuple):
    """What layouts that differ only in how dp communicates share: the step's compute and
    pipeline (`_micro_batch`, `_pipeline`) and the fuller pipeline rank's parameters."""

    compute_f: float
    compute_b: float
    t_f: float
    t_b: float
    bubble: float
    sends: float
    pipeline: float
    tp_comm: float
    ep_comm: float
    cp_comm: float
    rank: RankParams


def _pipelined(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster) -> _Pipelined:
    t, p, v, m = layout.tp, layout.pp, layout.virtual_stages, layout.micro_batches
    compute_f, compute_b, tp_f, tp_b, ep_f, ep_b, cp_f, cp_b, p2p = _micro_batch(model, layout, seq_len, cluster)
    calls = (tp_f + ep_f + cp_f, tp_b + ep_b + cp_b)
    parts = _pipeline(layout, cluster, (compute_f, compute_b), calls, p2p)
    ranks = (rank_params(model, t, p, v, r, layout.unit_numel, layout.ep) for r in {0, p - 1})
    rank = max(ranks, key=lambda r: r.numel)
    return _Pipelined(*parts, m * (tp_f + tp_b), m * (ep_f + ep_b), m * (cp_f + cp_b), rank)


def _optimizer_seconds(layout: Layout, rank: RankParams, cluster: Cluster) -> float:
    """The optimizer step: its shard's master, Adam state, gradient and parameter through HBM."""
    P, G = DTYPE_BYTES[layout.precision], DTYPE_BYTES[layout.reduce_dtype]
    optimized = rank.numel / layout.shard if layout.sharding.optimizer_state else rank.held  # experts: 1/ep held
    return optimized * (2 * 12 + G + P) / cluster.gpu.hbm_bandwidth * cluster.compute_share


def predict_step_times(model: GPTConfig, layouts: list[Layout], seq_len: int, cluster: Cluster) -> list[StepTime]:
    """Step times on `cluster` (the model in the module docstring) of layouts that differ at
    most in how dp communicates (`search.comm_variants`) and how cp ranks attend
    (`search.cp_variants`): the micro-batch is costed once per cp mode."""
    pipelines: dict[tuple, _Pipelined] = {}
    times = []
    for lo in layouts:
        mode = (lo.cp_mode, lo.cp_a2a)
        if mode not in pipelines:
            pipelines[mode] = _pipelined(model, lo, seq_len, cluster)
        shared = pipelines[mode]
        tied = tied_embedding(model, lo, cluster)
        collectives = dp_collectives(lo, cluster, shared.rank, shared.compute_f, shared.compute_b)
        collectives += (tied,) if tied else ()
        times.append(
            StepTime(
                shared.t_f,
                shared.t_b,
                shared.pipeline,
                shared.bubble,
                shared.tp_comm,
                shared.sends,
                sum(c.exposed for c in collectives),
                _optimizer_seconds(lo, shared.rank, cluster),
                collectives,
                shared.ep_comm,
                shared.cp_comm,
            )
        )
    return times


def step_time_floor(model: GPTConfig, layouts: list[Layout], seq_len: int, cluster: Cluster) -> float:
    """A lower bound of every `predict_step_times` total of `layouts` without their data-parallel
    collectives (which expose ≥ 0 s): the shortest pipeline of their cp modes plus the shortest
    optimizer step."""
    modes = {(lo.cp_mode, lo.cp_a2a): lo for lo in layouts}
    shared = [_pipelined(model, lo, seq_len, cluster) for lo in modes.values()]
    return min(x.pipeline for x in shared) + min(_optimizer_seconds(lo, shared[0].rank, cluster) for lo in layouts)


def predict_step_time(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster) -> StepTime:
    """Step time on `cluster` (the model in the module docstring)."""
    return predict_step_times(model, [layout], seq_len, cluster)[0]
