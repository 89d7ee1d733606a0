"""Analytic memory and step-time model of a training run: the planner's core.

Legend: s = sequence length, b = micro-batch size, h = d_model, a = heads, V = padded
vocabulary, L = layers, t / p / d = tp / pp / dp, v = virtual stages (chunks per pipeline
rank), m = micro-batches per step, P / G / A = bytes of a parameter (compute dtype), a
gradient (reduce dtype) and an activation (compute dtype). Ψ = parameters held by a rank.

Memory per GPU = model states + activations + buffers, for the fullest pipeline rank.

Model states, counted as `ZeroOptimizer.memory_breakdown` counts them (Rajbhandari et al.
2020, mixed-precision Adam: fp32 master + m + v):

    stage | params             | grads  | master (P < 4 only) | Adam m, v
      0   | PΨ                 | GΨ     | 4Ψ                  | 8Ψ
      1   | PΨ                 | GΨ     | 4Ψ/d                | 8Ψ/d
      2   | PΨ                 | GΨ/d   | 4Ψ/d                | 8Ψ/d
      3   | P(Ψ_res + Ψ_sh/d)  | GΨ/d   | 4Ψ/d                | 8Ψ/d

In fp32 the master is the parameter itself. At stage 3 a unit (`optim.stage3.stage3_units`)
smaller than `RESIDENT_NUMEL` (the Trainer's default) stays whole on every rank (Ψ_res). Ψ of a pipeline rank is
counted from the model's structure: its chunks' blocks with TP slices of the QKV / MLP /
vocabulary matrices and TP-replicated norms and row-parallel biases, the embedding (and
learned positions) on the first stage, the final norm and head on the last, and with tied
embeddings the last stage's own copy of the embedding when it is not also the first. Each
parameter is aligned to `optim.buffers.ALIGN` elements; bucket padding is ignored.

Activations per layer per micro-batch (Korthikanti et al. 2022, bytes with 16-bit
activations and 1-byte dropout masks; scaled by A/2):

    recompute | without SP                 | with SP
    none      | sbh(10 + 24/t + 5as/(ht))  | sbh(34/t + 5as/(ht))
    selective | sbh(10 + 24/t)             | sbh·34/t
    full      | 2sbh (the layer input)     | 2sbh/t      (+ one layer's `none` bytes while recomputed)

The 5as/(ht) term is the attention scores and softmax the paper's kernels keep; a fused
(flash) attention kernel keeps none, which the `selective` row describes.
A pipeline rank keeps them for its peak number of (micro-batch, chunk) pairs in flight,
read off the repo's own schedule (`parallel.pipeline`): p - r for 1F1B on rank r, p·v + p - 1
for interleaved 1F1B on rank 0, m for GPipe; each chunk holds L/(p·v) layers. The last
stage adds the output layer, 4sbh/t·(1 + V/h) (fp32 logits), per micro-batch at the head.

Buffers: at stages 2-3 with m > 1 the full gradient buckets live through the step (every
backward but the last runs under `no_sync`), GΨ(1 - 1/d); stage 3 holds two gathered units
(current and prefetched); plus `RESERVED_BYTES` (CUDA context, NCCL / cuBLAS workspaces,
allocator slack).

Step time, per micro-batch on the slowest pipeline rank (the last: L/p layers + the head):

    t_f = W_f/(η·peak) + M_f/HBM + C_f + X_f          t_b likewise for the backward

- W: matmul FLOPs, the terms of `GPTConfig.flops_per_token` (forward; backward 2×; full
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
what exceeds t_b/v is exposed; stages 1-2 then all-gather the parameters (PΨ(d-1)/d,
exposed); stage 3 all-gathers them before every forward and backward, exposed where one
exceeds the compute it is prefetched under. A tied embedding on two stages is all-reduced
once (exposed). The optimizer step streams its shard's master, Adam state, gradient and
parameter through HBM.
Bandwidth of a group that spans nodes: min(intra, k·inter) with k of its GPUs per node
(NCCL runs k rings through k NICs); p2p across nodes uses one NIC.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from optim.buffers import ALIGN
from parallel.pipeline.partition import layer_ranges
from parallel.pipeline.schedules import SCHEDULES, splits_backward, stage_of
from parallel.pipeline.schedules import validate as validate_schedule
from parallel.pipeline.simulate import peak_in_flight
from research.model import GPTConfig

if TYPE_CHECKING:
    from research.config import RunConfig

MiB, GiB = 2**20, 2**30
Recompute = Literal["none", "selective", "full"]
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Stage-3 unit sizes of the Trainer (ZeroOptimizer defaults): unit_numel = 2**22, resident = unit/16.
UNIT_NUMEL = 2**22
RESIDENT_NUMEL = UNIT_NUMEL // 16
RESERVED_BYTES = 2 * GiB
# η: the share of the 16-bit peak that a layer's GEMMs reach; the model's one calibrated
# constant. Fit once to Narayanan et al. 2021, Table 1, as a whole (tests/data/ptdp_table1.csv):
# 0.65 minimizes the largest relative error of the predicted TFLOP/s over the ten rows (8.6%;
# any value in 0.60-0.70 keeps every row within 15%). Element-wise memory traffic, pipeline
# bubbles and communication are modelled on their own, not folded into η.
MATMUL_EFFICIENCY = 0.65


# ---------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    """One accelerator. Bandwidths are bytes/s per GPU and direction: NVLink inside a node,
    the GPU's own NIC across nodes."""

    name: str
    memory_bytes: int
    peak_flops: float  # dense 16-bit tensor-core FLOP/s
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float


# Memory as nvidia-smi reports it; peaks and bandwidths from NVIDIA's datasheets (NVLink:
# half the bidirectional figure); networks of DGX nodes: 8 × HDR 200 Gb/s (A100),
# 8 × NDR 400 Gb/s (H100, H200).
GPUS: dict[str, GPU] = {
    "a100-40gb": GPU("a100-40gb", 40960 * MiB, 312e12, 1.555e12, 300e9, 25e9),
    "a100-80gb": GPU("a100-80gb", 81920 * MiB, 312e12, 2.039e12, 300e9, 25e9),
    "h100": GPU("h100", 81559 * MiB, 989.4e12, 3.35e12, 450e9, 50e9),
    "h200": GPU("h200", 143771 * MiB, 989.4e12, 4.8e12, 450e9, 50e9),
}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus: int
    gpus_per_node: int = 8

    def ring_bandwidth(self, size: int, stride: int) -> float:
        """Bus bandwidth of a collective over `size` ranks `stride` apart in the rank order
        (mesh (pp, dp, tp), tp innermost): NVLink if they share a node, else min(intra,
        k·inter) with k of them per node."""
        if size * stride <= self.gpus_per_node:
            return self.gpu.intra_node_bandwidth
        per_node = max(1, min(size, self.gpus_per_node // stride))
        return min(self.gpu.intra_node_bandwidth, per_node * self.gpu.inter_node_bandwidth)


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a run is laid out: parallel degrees, ZeRO stage, pipeline schedule, batching,
    recomputation, sequence parallelism and dtypes (global batch = b · m · dp)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    micro_batch_size: int = 1
    micro_batches: int = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.dp

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> Layout:
        """The layout of a resolved `research.config.RunConfig`."""
        return run_spec(cfg.to_dict())[1]

    def describe(self) -> str:
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} v={self.virtual_stages} zero={self.zero} "
                f"mbs={self.micro_batch_size} recompute={self.recompute} sp={int(self.sp)}")


def run_spec(config: Mapping[str, Mapping[str, Any]]) -> tuple[GPTConfig, Layout, int]:
    """(model, layout, sequence length) of a run's resolved config as a dict of sections
    (`RunConfig.to_dict()`: summary.json's "config", config.yaml)."""
    par, tr = config["parallel"], config["train"]
    layout = Layout(tp=par["tp"], pp=par["pp"], dp=par["dp"], zero=par["zero"], virtual_stages=par["virtual_stages"],
                    schedule=par["schedule"], micro_batch_size=tr["micro_batch_size"],
                    micro_batches=tr["micro_batches"], recompute=config["model"]["recompute"],
                    sequence_parallel=par["sequence_parallel"], precision=tr["precision"],
                    reduce_dtype=tr["reduce_dtype"])
    return GPTConfig(**config["model"]), layout, config["data"]["seq_len"]


# ---------------------------------------------------------------------------
# Parameters of a pipeline rank and model states
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Module:
    """A module as `optim.stage3.stage3_units` sees it: the numels of the trainable
    parameters it registers itself, its children, whether it has a forward."""

    own: tuple[int, ...] = ()
    children: tuple[_Module, ...] = ()
    called: bool = True


def _chunk(model: GPTConfig, tp: int, n_layers: int, pre: bool, post: bool) -> _Module:
    """The module tree of `research.model.GPT(layers=n_layers, pre, post)` at tensor-parallel
    size tp (children in registration order, so that the tied head's weight is already seen)."""
    h, f, V, t = model.d_model, model.ffn_dim, model.padded_vocab, tp
    mlp_in = (2 if model.activation == "swiglu" else 1) * f

    def linear(out_local: int, in_local: int, bias: int | None) -> _Module:
        return _Module((out_local * in_local,) + ((bias,) if bias else ()))

    norm = _Module((h,) if model.norm == "rmsnorm" else (h, h))
    attn = _Module(children=(linear(3 * h // t, h, 3 * h // t if model.qkv_bias else None),
                             linear(h, h // t, h if model.bias else None)))
    mlp = _Module(children=(linear(mlp_in // t, h, mlp_in // t if model.bias else None),
                            linear(h, f // t, h if model.bias else None)))
    block = _Module(children=(norm, attn, norm, mlp))
    children: list[_Module] = []
    if pre or (post and model.tie_embeddings):
        children.append(_Module((V // t * h,)))
    children.append(_Module(children=(block,) * n_layers, called=False))
    if post:
        head = _Module() if model.tie_embeddings else _Module((V // t * h,))
        children += [norm, head]
    pos = (model.max_seq_len * h,) if pre and model.position == "learned" else ()
    return _Module(pos, tuple(children))


def _aligned(numel: int) -> int:
    return -(-numel // ALIGN) * ALIGN


def _units(root: _Module, unit_numel: int) -> list[tuple[int, int]]:
    """(numel, aligned numel) of each stage-3 unit of one chunk, as `stage3_units` forms
    them: in post-order, a called module claims its subtree's unclaimed parameters once they
    reach unit_numel; the chunk (a root) claims the rest. The blocks of a chunk are one
    shared `_Module`, visited once."""
    seen: dict[int, tuple[list[tuple[int, int]], int, int]] = {}

    def visit(module: _Module, top: bool) -> tuple[list[tuple[int, int]], int, int]:
        """(units claimed in the subtree, unclaimed numel, unclaimed aligned numel)."""
        if id(module) in seen:
            return seen[id(module)]
        units: list[tuple[int, int]] = []
        raw, aligned = sum(module.own), sum(_aligned(n) for n in module.own)
        for child in module.children:
            child_units, r, a = visit(child, False)
            units, raw, aligned = units + child_units, raw + r, aligned + a
        if raw and module.called and (top or raw >= unit_numel):
            units, raw, aligned = units + [(raw, aligned)], 0, 0
        seen[id(module)] = units, raw, aligned
        return seen[id(module)]

    return visit(root, True)[0]


def unit_sizes(model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int,
               unit_numel: int = UNIT_NUMEL) -> list[tuple[int, int]]:
    """(numel, aligned numel) of the stage-3 units of pipeline rank `pp_rank`, which
    together hold all its parameters. Chunk c is virtual stage c·pp + pp_rank, with the
    layers `layer_ranges` gives it."""
    stages = pp * virtual_stages
    ranges = layer_ranges(model.n_layers, stages)
    units: list[tuple[int, int]] = []
    for c in range(virtual_stages):
        stage = stage_of(pp_rank, c, pp)
        units += _units(_chunk(model, tp, len(ranges[stage]), stage == 0, stage == stages - 1), unit_numel)
    return units


@dataclass(frozen=True)
class RankParams:
    """The parameters of one rank of a pipeline rank, as ZeroOptimizer holds them."""

    numel: int
    aligned: int  # each parameter aligned to ALIGN elements: what the buckets hold
    resident: int  # aligned numel in stage-3 units below RESIDENT_NUMEL (kept whole)
    largest_units: int  # aligned numel of the two largest sharded stage-3 units (gathered at once)


_RANK_PARAMS: dict[tuple, RankParams] = {}


def rank_params(model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int) -> RankParams:
    """`RankParams` of pipeline rank `pp_rank` (memoized)."""
    key = (*vars(model).values(), tp, pp, virtual_stages, pp_rank)
    if key not in _RANK_PARAMS:
        units = unit_sizes(model, tp, pp, virtual_stages, pp_rank)
        sharded = sorted((a for raw, a in units if raw >= RESIDENT_NUMEL), reverse=True)
        _RANK_PARAMS[key] = RankParams(
            numel=sum(raw for raw, _ in units), aligned=sum(a for _, a in units),
            resident=sum(a for raw, a in units if raw < RESIDENT_NUMEL), largest_units=sum(sharded[:2]))
    return _RANK_PARAMS[key]


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank, in `ZeroOptimizer.memory_breakdown`'s categories."""

    params: float
    grads: float
    master_and_optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master_and_optimizer


def predict_model_states(model: GPTConfig, layout: Layout, pp_rank: int = 0) -> ModelStates:
    """Model-state bytes of one rank of pipeline rank `pp_rank` (the table in the module
    docstring), for the Trainer's ZeroOptimizer (default unit sizes)."""
    P, G, d, stage = DTYPE_BYTES[layout.precision], DTYPE_BYTES[layout.reduce_dtype], layout.dp, layout.zero
    rank = rank_params(model, layout.tp, layout.pp, layout.virtual_stages, pp_rank)
    psi = rank.aligned
    params = P * (psi if stage < 3 else rank.resident + (psi - rank.resident) / d)
    grads = G * psi / (d if stage >= 2 else 1)
    optimized = psi / (d if stage >= 1 else 1)
    master = 4 * optimized if P < 4 else 0
    return ModelStates(params, grads, master + 8 * optimized)


# ---------------------------------------------------------------------------
# Activations and memory
# ---------------------------------------------------------------------------


def layer_activation_bytes(model: GPTConfig, seq_len: int, layout: Layout, recompute: Recompute | None = None) -> float:
    """Bytes one layer keeps for backward per micro-batch (Korthikanti et al. 2022, the
    table in the module docstring; `recompute` defaults to the layout's)."""
    s, b, h, a, t = seq_len, layout.micro_batch_size, model.d_model, model.n_heads, layout.tp
    sbh = s * b * h * DTYPE_BYTES[layout.precision] / 2
    recompute = recompute or layout.recompute
    if recompute == "full":
        return 2 * sbh / (t if layout.sp else 1)
    scores = 5 * a * s / (h * t) if recompute == "none" else 0.0
    return sbh * ((34 / t if layout.sp else 10 + 24 / t) + scores)


@functools.lru_cache(maxsize=4096)
def in_flight(schedule_name: str, pp: int, pp_rank: int, micro_batches: int, virtual_stages: int) -> int:
    """Peak (micro-batch, chunk) pairs whose forward ran and backward did not, on `pp_rank`,
    read off the repo's schedule."""
    validate_schedule(schedule_name, pp, micro_batches, virtual_stages)
    compute = SCHEDULES[schedule_name](pp, pp_rank, micro_batches, virtual_stages)
    return peak_in_flight(compute, splits_backward(schedule_name))


@dataclass(frozen=True)
class Memory:
    """Predicted bytes per GPU of the fullest pipeline rank `pp_rank`."""

    pp_rank: int
    model_states: ModelStates
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.model_states.total + self.activations + self.buffers


def _rank_memory(model: GPTConfig, layout: Layout, seq_len: int, pp_rank: int) -> Memory:
    s, b, h, t = seq_len, layout.micro_batch_size, model.d_model, layout.tp
    p, v, m = layout.pp, layout.virtual_stages, layout.micro_batches
    states = predict_model_states(model, layout, pp_rank)
    layers_per_chunk = model.n_layers // (p * v)
    acts = in_flight(layout.schedule, p, pp_rank, m, v) * layers_per_chunk * layer_activation_bytes(model, s, layout)
    if layout.recompute == "full":
        acts += layer_activation_bytes(model, s, layout, "none")
    if pp_rank == p - 1:
        at_head = m if layout.schedule == "gpipe" else 1
        acts += at_head * 4 * s * b * h / t * (1 + model.padded_vocab / h)
    buffers = float(RESERVED_BYTES)
    rank = rank_params(model, t, p, v, pp_rank)
    if layout.zero >= 2 and m > 1:
        buffers += DTYPE_BYTES[layout.reduce_dtype] * rank.aligned * (1 - 1 / layout.dp)
    if layout.zero == 3:
        buffers += DTYPE_BYTES[layout.precision] * rank.largest_units
    return Memory(pp_rank, states, acts, buffers)


def predict_memory(model: GPTConfig, layout: Layout, seq_len: int, pp_rank: int | None = None) -> Memory:
    """Predicted per-GPU memory of `pp_rank`, or of the fuller of the first and last
    pipeline ranks (the middle ones hold fewer parameters and fewer micro-batches than the
    first)."""
    if pp_rank is not None:
        return _rank_memory(model, layout, seq_len, pp_rank)
    ranks = {0, layout.pp - 1}
    return max((_rank_memory(model, layout, seq_len, r) for r in ranks), key=lambda mem: mem.total)


# ---------------------------------------------------------------------------
# Step time
# ---------------------------------------------------------------------------


def forward_flops_per_token(model: GPTConfig, seq_len: int) -> tuple[float, float, float]:
    """(layer, attention core, head) forward matmul FLOPs per token: the terms of
    `GPTConfig.flops_per_token` (QKV 6h², scores and weighted sum 4sh, projection 2h², MLP
    2hf per matrix; head 2hV)."""
    h, f = model.d_model, model.ffn_dim
    attn_core = 4 * seq_len * h
    mlp_mats = 3 if model.activation == "swiglu" else 2
    return 8 * h * h + attn_core + mlp_mats * 2 * h * f, attn_core, 2 * h * model.padded_vocab


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
    layer, core, head = forward_flops_per_token(model, s)
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
    reduce = G * psi * share / dp_bw * (2 if layout.zero == 0 else 1)
    dp = max(0.0, reduce - t_b / v)
    if layout.zero in (1, 2):
        dp += P * psi * share / dp_bw
    if layout.zero == 3:
        gather = P * psi * share / dp_bw
        dp += m * (max(0.0, gather - compute_f) + max(0.0, gather - compute_b))
    if p > 1 and model.tie_embeddings:
        dp += G * model.padded_vocab / t * h / gpu.inter_node_bandwidth
    optimized = psi / (d if layout.zero >= 1 else 1)
    optimizer = optimized * (2 * 12 + G + P) / gpu.hbm_bandwidth
    return StepTime(t_f, t_b, pipeline, bubble, m * (tp_f + tp_b), m * 2 * p2p, dp, optimizer)


# ---------------------------------------------------------------------------
# Estimates and the planner
# ---------------------------------------------------------------------------


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


def candidate_layouts(model: GPTConfig, cluster: Cluster, global_batch_size: int, seq_len: int,
                      max_virtual_stages: int = 8, max_micro_batch_size: int = 32,
                      **fixed: object) -> Iterator[tuple[Layout, tuple[str, str] | None, int]]:
    """Every (tp, pp, dp, v, zero, b, recompute, SP) on `cluster`, tp inside a node,
    b a divisor of `max_micro_batch_size`, interleaved 1F1B when v > 1: (layout, None, 1)
    when it can run, else (layout, (reason, detail), n), where a split (tp, pp, v, b) that
    cannot run stands for all n of its ZeRO / recompute / SP variants. `fixed` pins Layout
    fields, e.g. tp=8, zero=0."""
    unknown = set(fixed) - {"tp", "pp", "virtual_stages", "micro_batch_size", "zero", "recompute", "sequence_parallel"}
    if unknown:
        raise TypeError(f"cannot pin {', '.join(sorted(unknown))}: the planner chooses tp, pp, virtual_stages, "
                        "micro_batch_size, zero, recompute and sequence_parallel")

    def choices(name: str, values: list) -> list:
        return [x for x in values if x == fixed[name]] if name in fixed else values

    gpus = cluster.gpus
    for tp in choices("tp", [k for k in _divisors(min(gpus, cluster.gpus_per_node)) if gpus % k == 0]):
        variants = [(zero, recompute, sp) for zero in choices("zero", [0, 1, 2, 3])
                    for recompute in choices("recompute", ["none", "selective", "full"])
                    for sp in choices("sequence_parallel", [False, True] if tp > 1 else [False])]
        for pp in choices("pp", _divisors(gpus // tp)):
            dp = gpus // (tp * pp)
            for v in choices("virtual_stages", list(range(1, (max_virtual_stages if pp > 1 else 1) + 1))):
                for mbs in choices("micro_batch_size", _divisors(max_micro_batch_size)):
                    m = max(1, global_batch_size // (dp * mbs))
                    name = "interleaved-1f1b" if v > 1 else "1f1b"
                    why = _why_invalid(model, tp, pp, dp, v, mbs, m, name, global_batch_size)
                    if why is not None and variants:
                        yield Layout(tp, pp, dp, variants[0][0], v, name, mbs, m, *variants[0][1:]), why, len(variants)
                        continue
                    for zero, recompute, sp in variants:
                        layout = Layout(tp, pp, dp, zero, v, name, mbs, m, recompute, sp)
                        if layout.sp and seq_len % tp:
                            yield layout, ("sequence parallelism needs seq_len divisible by tp",
                                           f"seq_len={seq_len}, tp={tp}"), 1
                        else:
                            yield layout, None, 1


def _why_invalid(model: GPTConfig, tp: int, pp: int, dp: int, v: int, mbs: int, m: int, schedule_name: str,
                 global_batch_size: int) -> tuple[str, str] | None:
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
            result.reject("does not fit in memory", layout,
                          f"needs {memory.total / GiB:.2f} GiB > {capacity / GiB:.2f} GiB", miss=memory.total)
            continue
        result.ranked.append(estimate(model, layout, seq_len, cluster))
    result.ranked.sort(key=lambda e: (e.time.total, e.memory.total, e.layout.zero))
    return result
