"""Per-GPU memory of a layout: model states, activations and buffers, for the fullest pipeline rank.

Legend in `research.costmodel`.

Model states, counted as `ZeroOptimizer.memory_breakdown` counts them (Rajbhandari et al.
2020, mixed-precision Adam: fp32 master + m + v):

    stage | params             | grads  | master (P < 4 only) | Adam m, v
      0   | PΨ                 | GΨ     | 4Ψ                  | 8Ψ
      1   | PΨ                 | GΨ     | 4Ψ/N                | 8Ψ/N
      2   | PΨ                 | GΨ/N   | 4Ψ/N                | 8Ψ/N
      3   | P(Ψ_res + Ψ_sh/N)  | GΨ/N   | 4Ψ/N                | 8Ψ/N

N = the shard group's size: dp, or `dp_shard` under hybrid sharding (each replica holds the
same shards).

In fp32 the master is the parameter itself. At stage 3 a unit (`optim.stage3.stage3_units`)
smaller than `optim.policies.default_resident_numel(layout.unit_numel)` stays whole on every rank
(Ψ_res). Ψ and the units of a pipeline rank are read off the model itself, built on the meta
device (`research.costmodel.params`). Each parameter is aligned to `optim.buffers.ALIGN`
elements; bucket padding is ignored.

Activations per layer per micro-batch (Korthikanti et al. 2022, bytes with 16-bit
activations and 1-byte dropout masks; scaled by A/2):

    recompute | without SP                 | with SP
    none      | sbh(10 + 24/t + 5as/(ht))  | sbh(34/t + 5as/(ht))
    selective | sbh(10 + 24/t)             | sbh·34/t
    full      | 2sbh (the layer input)     | 2sbh/t      (+ one layer's `none` bytes while recomputed)

The 5as/(ht) term is the attention scores, softmax and its dropout mask that the paper's
unfused kernels keep (`Layout.attention` "unfused"). The model's attention core is torch's
fused scaled_dot_product_attention (flash or memory-efficient kernels), which keeps only
O(s) row statistics: for it (`attention` "fused", the default) the term is 0 and `none`
keeps what `selective` keeps (measured on an H200, 1.31B GPT: within 0.1 %), so selective
recompute only costs time.
MoE layers (`--moe-experts`) keep the block's input, norms and attention as above and, in
place of the dense MLP's input and two [s, b, 4h] tensors (A·sbh, /t under SP, and 8A·sbh/t
of the 34), what the MoE MLP saves (`moe_mlp_bytes`, read off the layer's saved tensors),
with T = sb tokens, R = T·k rows a rank's experts take (balanced routing: an uneven router raises the busiest rank's; with a
capacity factor c, R = c·T·k slots, padding included), T_r = T/t router tokens under SP (T
without), G = 2 for SwiGLU (1 for GELU), f the expert width:

    router (fp32):   (4h + 8E + 12k + 8)·T_r (its fp32 input, logits, probabilities, top-k)
                     + 4hE when A < 4 (the fp32 copy of its weight)
    experts:         A·h·3Tk (rows in, outputs, weighted outputs) + A·Tk (weights)
                     + 2G·A·R·f/t (hidden) + 24·Tk (the dispatch's int64 indices);
                     with a capacity: + A·h·R (the padded rows) and 32·Tk for the indices
    shared experts:  2G·A·T·f_s/t, and their input A·h·T_r when A < 4 (in fp32 the router's)

Every TP rank runs its experts' f/t slice on all T tokens of the group (gathered under SP).
With float8 linear layers (`Layout.fp8`, `--fp8`) a layer saves, per the A-byte tensor of
the table, the QKV and MLP-up inputs and the MLP-down input (f wide) in 1 byte, the
projection's input once more (1 byte: the attention kernel keeps its own copy), as
`fp8_bytes` counts (measured to the byte on the saved tensors).

A pipeline rank keeps them for its peak number of (micro-batch, chunk) pairs in flight,
read off the repo's own schedule (`parallel.pipeline`): p - r for 1F1B on rank r, p·v + p - 1
for interleaved 1F1B on rank 0, m for GPipe; each chunk holds L/(p·v) layers. The last
stage adds the output layer, 4sbh/t·(1 + V/h) (fp32 logits), per micro-batch at the head.

Buffers: at stages 2-3 with m > 1 and `grad_sync` last the full gradient buckets live through
the step (every backward but the last runs under `no_sync`), G(Ψ_held − Ψ/N) (GΨ(1 − 1/N)
without experts); with `grad_sync` every each backward reduces its chunk as it goes, like m = 1 (the few buckets in flight
are not counted, as at m = 1); stage 3 holds two gathered units
(current and prefetched), and with ZeRO++ hpZ each rank's 1/k slice of every sharded unit,
PΨ_sh/k (k = the shard group's ranks on a node; from a step's first forward to its optimizer
step, when `memory_breakdown` counts it under params); plus `RESERVED_BYTES` (CUDA context,
NCCL / cuBLAS workspaces, allocator slack). qwZ's and qgZ's quantized buffers are not counted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from parallel.pipeline.schedules import SCHEDULES, splits_backward
from parallel.pipeline.schedules import validate as validate_schedule
from parallel.pipeline.simulate import peak_in_flight
from research.costmodel.hardware import GiB, ranks_per_node
from research.costmodel.layout import DTYPE_BYTES, Layout, Recompute
from research.costmodel.params import rank_params
from research.model import GPTConfig

RESERVED_BYTES = 2 * GiB


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
    docstring), for the Trainer's ZeroOptimizer."""
    P, G, d, sharded = DTYPE_BYTES[layout.precision], DTYPE_BYTES[layout.reduce_dtype], layout.shard, layout.sharding
    rank = rank_params(model, layout.tp, layout.pp, layout.virtual_stages, pp_rank, layout.unit_numel, layout.ep)
    psi, whole = rank.aligned, rank.held  # ZeRO shards psi over N; a rank holds `whole` unsharded
    params = P * (rank.resident + (psi - rank.resident_volume) / d if sharded.parameters else whole)
    grads = G * (psi / d if sharded.gradients else whole)
    optimized = psi / d if sharded.optimizer_state else whole
    master = 4 * optimized if P < 4 else 0
    return ModelStates(params, grads, master + 8 * optimized)


def layer_activation_bytes(
    model: GPTConfig, seq_len: int, layout: Layout, recompute: Recompute | None = None, moe: bool = False
) -> float:
    """Bytes one layer (an MoE one with `moe`) keeps for backward per micro-batch (Korthikanti
    et al. 2022, the table in the module docstring; `recompute` defaults to the layout's)."""
    s, b, h, a, t = seq_len, layout.micro_batch_size, model.d_model, model.n_heads, layout.tp
    A = DTYPE_BYTES[layout.precision]
    sbh = s * b * h * A / 2
    recompute = recompute or layout.recompute
    if recompute == "full":
        return 2 * sbh / (t if layout.sp else 1)
    scores = 5 * a * s / (h * t) if recompute == "none" and layout.attention == "unfused" else 0.0
    dense = sbh * ((34 / t if layout.sp else 10 + 24 / t) + scores) + (
        fp8_bytes(model, seq_len, layout, moe) if layout.fp8 else 0.0
    )
    if not moe:
        return dense
    mlp = A * s * b * h * (8 / t + (1 / t if layout.sp else 1))  # the dense MLP's input and hidden tensors
    return dense - mlp + moe_mlp_bytes(model, seq_len, layout)


def fp8_bytes(model: GPTConfig, seq_len: int, layout: Layout, moe: bool = False) -> float:
    """What float8 linear layers change in a layer's saved bytes (the module docstring): the
    QKV and MLP-up inputs saved in 1 byte instead of A, the MLP-down input (f wide) too, the
    projection's input once more in float8 (the attention kernel keeps its own copy); an MoE
    layer's experts stay in bf16."""
    s, b, h, t, A = seq_len, layout.micro_batch_size, model.d_model, layout.tp, DTYPE_BYTES[layout.precision]
    replicated = 1 / t if layout.sp else 1
    tokens, f = s * b, model.ffn_dim
    attention = (-(A - 1) * replicated + 1 / t) * tokens * h
    mlp = -(A - 1) * tokens * (h * replicated + f / t)
    return attention + (0.0 if moe else mlp)


def moe_mlp_bytes(model: GPTConfig, seq_len: int, layout: Layout) -> float:
    """Bytes an MoE MLP keeps for backward per micro-batch beyond its input (the module
    docstring's router, experts and shared experts)."""
    moe, A, t = model.moe, DTYPE_BYTES[layout.precision], layout.tp
    h, G, capped = model.d_model, 2 if moe.swiglu else 1, moe.capacity_factor is not None
    tokens = seq_len * layout.micro_batch_size
    routed = tokens / t if layout.sp else tokens
    slots = tokens * moe.top_k
    rows = slots * (moe.capacity_factor or 1)
    router = (4 * h + 8 * moe.experts + 12 * moe.top_k + 8) * routed + 4 * h * moe.experts * (A < 4)
    experts = A * h * (3 * slots + rows * capped) + A * slots + 2 * G * A * rows * moe.d_ff / t
    indices = (32 if capped else 24) * slots
    shared = (2 * G * A * tokens * moe.shared_d_ff / t + A * h * routed * (A < 4)) if moe.shared_d_ff else 0.0
    return router + experts + indices + shared


def chunk_activation_bytes(model: GPTConfig, seq_len: int, layout: Layout, recompute: Recompute | None = None) -> float:
    """Bytes the fullest chunk's layers keep per micro-batch: L/(p·v) layers, as many of them
    MoE layers as the chunk with the most holds."""
    n = model.n_layers // (layout.pp * layout.virtual_stages)
    most = max(sum(map(model.is_moe, range(c * n, (c + 1) * n))) for c in range(model.n_layers // n))
    dense, moe = (layer_activation_bytes(model, seq_len, layout, recompute, m) for m in (False, True))
    return (n - most) * dense + most * moe


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


def _rank_memory(model: GPTConfig, layout: Layout, seq_len: int, pp_rank: int, gpus_per_node: int) -> Memory:
    s, b, h, t = seq_len, layout.micro_batch_size, model.d_model, layout.tp
    p, v, m = layout.pp, layout.virtual_stages, layout.micro_batches
    states = predict_model_states(model, layout, pp_rank)
    acts = in_flight(layout.schedule, p, pp_rank, m, v) * chunk_activation_bytes(model, s, layout)
    if layout.recompute == "full":
        acts += layer_activation_bytes(model, s, layout, "none", moe=bool(model.moe_experts))
    if pp_rank == p - 1:
        at_head = m if layout.schedule == "gpipe" else 1
        acts += at_head * 4 * s * b * h / t * (1 + model.padded_vocab / h)
    buffers = float(RESERVED_BYTES)
    rank = rank_params(model, t, p, v, pp_rank, layout.unit_numel, layout.ep)
    if layout.sharding.gradients and m > 1 and layout.grad_sync == "last":
        buffers += DTYPE_BYTES[layout.reduce_dtype] * (rank.held - rank.aligned / layout.shard)  # whole less its shard
    if layout.sharding.parameters:
        buffers += DTYPE_BYTES[layout.precision] * rank.largest_units
    if layout.hpz:
        k = ranks_per_node(layout.shard, t, gpus_per_node)
        buffers += DTYPE_BYTES[layout.precision] * (rank.aligned - rank.resident_volume) / k
    return Memory(pp_rank, states, acts, buffers)


def predict_memory(
    model: GPTConfig, layout: Layout, seq_len: int, pp_rank: int | None = None, gpus_per_node: int = 8
) -> Memory:
    """Predicted per-GPU memory of `pp_rank`, or of the fuller of the first and last
    pipeline ranks (the middle ones hold fewer parameters and fewer micro-batches than the
    first); `gpus_per_node` places hpZ's partition."""
    if pp_rank is not None:
        return _rank_memory(model, layout, seq_len, pp_rank, gpus_per_node)
    ranks = {0, layout.pp - 1}
    return max((_rank_memory(model, layout, seq_len, r, gpus_per_node) for r in ranks), key=lambda mem: mem.total)
