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
DP: gradients are reduced (all-reduce at stage 0, reduce-scatter at 1-3: GΨ(d-1)/d bytes
per rank and direction, an all-reduce twice that) during the rank's last backward, so only
what exceeds t_b/v is exposed; with `grad_sync` every each of the m·v backwards reduces its
chunk's 1/v under its own t_b/v, m·max(0, reduce - t_b) exposed; stages 1-2 then all-gather the parameters (PΨ(d-1)/d,
exposed); stage 3 all-gathers them before every forward and backward, exposed where one
exceeds the compute it is prefetched under. A tied embedding on two stages is all-reduced
once (exposed). The optimizer step streams its shard's master, Adam state, gradient and
parameter through HBM.
Bandwidth of a group that spans nodes: min(intra, k·inter) with k of its GPUs per node
(NCCL runs k rings through k NICs); p2p across nodes uses one NIC.
"""

from __future__ import annotations

from dataclasses import dataclass

from research.costmodel.hardware import Cluster
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

    @property
    def total(self) -> float:
        return self.pipeline + self.dp_comm + self.optimizer


def pipeline_bubble(schedule_name: str, pp: int, virtual_stages: int, t_forward: float, t_backward: float) -> float:
    """Idle time of a step beyond m(t_f + t_b): (p-1)(t_f + t_b)/v, or (p-1)·max(t_f, t_b/2)
    for zb-h1 (B and W halves of the backward), as `parallel.pipeline.simulate` measures it."""
    if schedule_name == "zb-h1":
        return (pp - 1) * max(t_forward, t_backward / 2)
    return (pp - 1) * (t_forward + t_backward) / virtual_stages


def predict_step_time(model: GPTConfig, layout: Layout, seq_len: int, cluster: Cluster) -> StepTime:
    """Step time on `cluster` (the model in the module docstring)."""
    gpu, s, b, h = cluster.gpu, seq_len, layout.micro_batch_size, model.d_model
    t, p, d, v, m = layout.tp, layout.pp, layout.dp, layout.virtual_stages, layout.micro_batches
    A = P = DTYPE_BYTES[layout.precision]
    G = DTYPE_BYTES[layout.reduce_dtype]
    layers = model.n_layers // p
    tokens = s * b / t
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
    msg = s * b * h * A
    all_reduce = 2 * (t - 1) / t * msg / cluster.ring_bandwidth(t, 1)
    tp_f = 2 * layers * all_reduce
    tp_b = (2 + (layout.recompute == "full")) * layers * all_reduce
    p2p = 0.0
    if p > 1:
        link = gpu.intra_node_bandwidth if t * d * p <= cluster.gpus_per_node else gpu.inter_node_bandwidth
        p2p = v * msg / (t if layout.sp else 1) / link
    t_f, t_b = compute_f + tp_f + p2p, compute_b + tp_b + p2p
    bubble = pipeline_bubble(layout.schedule, p, v, t_f, t_b)
    pipeline = m * (t_f + t_b) + bubble

    psi = max(rank_params(model, t, p, v, r).numel for r in {0, p - 1})
    dp_bw = cluster.ring_bandwidth(d, t)
    share = (d - 1) / d
    sharded = layout.sharding
    reduce = G * psi * share / dp_bw * (1 if sharded.optimizer_state else 2)  # reduce-scatter, or all-reduce
    dp = m * max(0.0, reduce - t_b) if layout.grad_sync == "every" else max(0.0, reduce - t_b / v)
    if sharded.optimizer_state and not sharded.parameters:  # the updated parameters all-gathered
        dp += P * psi * share / dp_bw
    if sharded.parameters:
        gather = P * psi * share / dp_bw
        dp += m * (max(0.0, gather - compute_f) + max(0.0, gather - compute_b))
    if p > 1 and model.tie_embeddings:
        dp += G * model.padded_vocab / t * h / gpu.inter_node_bandwidth
    optimized = psi / (d if sharded.optimizer_state else 1)
    optimizer = optimized * (2 * 12 + G + P) / gpu.hbm_bandwidth
    return StepTime(t_f, t_b, pipeline, bubble, m * (tp_f + tp_b), m * 2 * p2p, dp, optimizer)
