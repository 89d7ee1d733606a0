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
same shards), times cp (context-parallel ranks hold the same parameters: ZeRO shards over
dp × cp).

In fp32 the master is the parameter itself. At stage 3 a unit (`optim.stage3.stage3_units`)
smaller than `optim.policies.default_resident_numel(layout.unit_numel)` stays whole on every rank
(Ψ_res). Ψ and the units of a pipeline rank are read off the model itself, built on the meta
device (`research.costmodel.params`). Each parameter is aligned to `optim.buffers.ALIGN`
elements; bucket padding is ignored.

Activations per layer per micro-batch, read off what the model's layer saves for backward
(`Layout.attention` "fused", the default), with T = sb/c tokens (c = cp: a rank holds s/c
of each sequence's tokens; at c = 1 T = sb), T_r the residual stream's
tokens on a rank (T/t under SP, else T), f the MLP width, A the bytes of an activation:

    saved for backward                                      | by                  | bytes
    layer input; the residual after attention               | the two norms       | 2A·h·T_r
    their statistics, fp32 (mean, 1/σ; RMSNorm 1/rms only)  | the two norms       | 2·4n·T_r, n = 2 (1)
    the norms' outputs; under SP their sequence shards,     | QKV, MLP-up         | 2A·h·T_r
      all-gathered again in backward for dW
    q, k, v: the QKV output, or with RoPE its rotated copy  | attention core      | 3A·h·T/t
      in its place (the rotation's adjoint needs only cos, sin)
    attention output                                        | core, projection    | A·h·T/t
    log-sum-exp per row, fp32 (recompute none only)         | attention core      | 4a·T/t
    dropout masks, 1 byte (dropout p > 0)                   | both branches       | 2h·T_r
    GELU input, its output                                  | GELU, MLP-down      | 2A·f·T/t
    SwiGLU: [gate, up], silu(gate), their product           | SwiGLU, MLP-down    | 4A·f·T/t

Recompute none keeps all of it; selective all but the log-sum-exp (the checkpointed core
keeps its input, the QKV output, and the projection its output); full the layer input,
A·h·T_r (+ one layer's `none` bytes while it is recomputed). Biases and positions add
nothing per layer: a bias's gradient is a sum of its output's, learned positions join
before the first layer and RoPE's cos / sin tables are one buffer for all layers. The
attention core's own dropout keeps no mask (the flash kernel draws it again from a seed).
At the paper's layer (GELU with f = 4h, p > 0, A = 2; statistics and log-sum-exp aside)
this is Korthikanti et al. 2022's selective row, sbh(10 + 24/t) without SP and 34sbh/t
with SP; tests/test_activation_memory.py measures it on the saved tensors.

`Layout.attention` "unfused" predicts the paper's own layer whatever the model's options
(Table 2: GELU 4h, dropout after attention and MLP, attention that keeps its scores,
softmax, dropout mask and dropout output, 5as²b/t), in bytes at A = 2, scaled by A/2:

    recompute | without SP                 | with SP
    none      | sbh(10 + 24/t + 5as/(ht))  | sbh(34/t + 5as/(ht))
    selective | sbh(10 + 24/t)             | sbh·34/t
    full      | 2sbh (the layer input)     | 2sbh/t

MoE layers (`--moe-experts`) keep the block's input, norms and attention as above and, in
place of the dense MLP's input and hidden tensors (A·h·T_r and the GELU / SwiGLU row above;
the paper's A·sbh, /t under SP, and 8A·sbh/t), what the MoE MLP saves (`moe_mlp_bytes`,
read off the layer's saved tensors), with R = T·k rows a rank's experts take (balanced
routing: an uneven router raises the busiest rank's; with a capacity factor c, R = c·T·k
slots, padding included), G = 2 for SwiGLU (1 for GELU), f the expert width:

    router (fp32):   (4h + 8E + 12k + 8)·T_r (its fp32 input, logits, probabilities, top-k)
                     + 4hE when A < 4 (the fp32 copy of its weight)
    experts:         A·h·3Tk (rows in, outputs, weighted outputs) + A·Tk (weights)
                     + 2G·A·R·f/t (hidden) + 24·Tk (the dispatch's int64 indices);
                     with a capacity: + A·h·R (the padded rows) and 32·Tk for the indices
    shared experts:  2G·A·T·f_s/t, and their input A·h·T_r when A < 4 (in fp32 the router's)

Every TP rank runs its experts' f/t slice on all T tokens of the group (gathered under SP).
With float8 linear layers (`Layout.fp8`, `--fp8`) the QKV and MLP-up linears keep their
input in 1 byte, all-gathered under SP (h·T in place of A·h·T_r), the MLP-down its input
(f wide) in 1 byte in place of A, and the projection its input in 1 byte: once more with
recompute none (the attention core keeps its own A-byte copy), in place of the A-byte one
under selective recompute; `fp8_bytes` counts the difference (measured to the scales' few
bytes on the saved tensors).

A pipeline rank keeps them for its peak number of (micro-batch, chunk) pairs in flight,
read off the repo's own schedule (`parallel.pipeline`): p - r for 1F1B on rank r, p·v + p - 1
for interleaved 1F1B on rank 0, m for GPipe; each chunk holds L/(p·v) layers. The last
stage adds the output layer, 4Th/t·(1 + V/h) (fp32 logits), per micro-batch at the head.

Context parallelism (`Layout.cp` = c): every count above is of the rank's T = sb/c tokens
(activations and logits ÷ c; the attention's saved q, k, v, output and log-sum-exp are the
same bytes in every mode: ring and hybrid keep the rank's s/c queries and keys, all-to-all
all s tokens of h/(t·c) of the width). A ring (and hybrid's ring) holds, while a layer's
attention runs, the K/V block it computes on and the one arriving: 2 × 2A·T·h/t
(`ring_kv_bytes`), once per rank. All-to-all's send and receive buffers are transient and
not counted.

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

from dataclasses import dataclass, replace

from parallel.pipeline.schedules import SCHEDULES
from parallel.pipeline.schedules import validate as validate_schedule
from research.costmodel.hardware import GiB, ranks_per_node
from research.costmodel.layout import DTYPE_BYTES, Layout, Recompute
from research.costmodel.params import rank_params
from research.model import GPTConfig

RESERVED_BYTES = 2 * GiB
NORM_STATISTICS = {"layernorm": 2, "rmsnorm": 1}  # fp32 values per token a norm keeps for backward


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
    """Bytes one layer (an MoE one with `moe`) keeps for backward per micro-batch: the model's
    layer, or the paper's with unfused attention (the tables in the module docstring;
    `recompute` defaults to the layout's)."""
    recompute = recompute or layout.recompute
    paper = layout.attention == "unfused"
    saved = (_paper_layer_bytes if paper else _model_layer_bytes)(model, seq_len, layout, recompute)
    if recompute == "full":
        return saved
    if layout.fp8:
        saved += fp8_bytes(model, seq_len, replace(layout, recompute=recompute), moe)
    if moe:
        saved += moe_mlp_bytes(model, seq_len, layout) - _dense_mlp_bytes(model, seq_len, layout, paper)
    return saved


def _model_layer_bytes(model: GPTConfig, seq_len: int, layout: Layout, recompute: Recompute) -> float:
    """The model's layer, the first table of the module docstring: 2(A·h + 4n)·T_r (norms)
    + 2A·h·T_r (QKV, MLP-up inputs) + 4A·h·T/t (q, k, v, attention output) + 4a·T/t
    (log-sum-exp, recompute none) + 2h·T_r (masks, p > 0) + 2A·f·T/t (GELU) or 4A·f·T/t
    (SwiGLU); A·h·T_r under full recompute."""
    T, h, t, A = layout.tokens(seq_len), model.d_model, layout.tp, DTYPE_BYTES[layout.precision]
    T_r = T / t if layout.sp else T
    if recompute == "full":
        return A * h * T_r
    norms = 2 * (A * h + 4 * NORM_STATISTICS[model.norm]) * T_r
    linear_inputs = 2 * A * h * T_r
    attention = 4 * A * h * T / t + (4 * model.n_heads * T / t if recompute == "none" else 0.0)
    masks = 2 * h * T_r if model.dropout > 0 else 0.0
    return norms + linear_inputs + attention + masks + _hidden_bytes(model, T, layout)


def _hidden_bytes(model: GPTConfig, tokens: int, layout: Layout) -> float:
    """The dense MLP's hidden tensors: GELU's input and output, or SwiGLU's [gate, up],
    silu(gate) and their product, f/t wide."""
    width = (4 if model.activation == "swiglu" else 2) * model.ffn_dim / layout.tp
    return DTYPE_BYTES[layout.precision] * tokens * width


def _paper_layer_bytes(model: GPTConfig, seq_len: int, layout: Layout, recompute: Recompute) -> float:
    """Korthikanti et al. 2022's layer, the second table of the module docstring."""
    s, h, a, t = seq_len, model.d_model, model.n_heads, layout.tp
    sbh = layout.tokens(s) * h * DTYPE_BYTES[layout.precision] / 2  # the rank's s/cp queries
    if recompute == "full":
        return 2 * sbh / (t if layout.sp else 1)
    scores = 5 * a * s / (h * t) if recompute == "none" else 0.0  # against all s keys
    return sbh * ((34 / t if layout.sp else 10 + 24 / t) + scores)


def _dense_mlp_bytes(model: GPTConfig, seq_len: int, layout: Layout, paper: bool) -> float:
    """What an MoE layer keeps in place of the dense MLP's: its input and hidden tensors."""
    T, h, t, A = layout.tokens(seq_len), model.d_model, layout.tp, DTYPE_BYTES[layout.precision]
    T_r = T / t if layout.sp else T
    return A * h * (T_r + 8 * T / t) if paper else A * h * T_r + _hidden_bytes(model, T, layout)


def fp8_bytes(model: GPTConfig, seq_len: int, layout: Layout, moe: bool = False) -> float:
    """What float8 linear layers change in a layer's saved bytes (the module docstring): the
    QKV and MLP-up inputs kept in 1 byte, gathered under SP, in place of A bytes (shards under
    SP), the MLP-down input (f wide) in 1 byte too, the projection's input in 1 byte once more
    (recompute none: the attention core keeps its own copy) or in place of the A-byte one
    (selective); an MoE layer's experts stay in bf16. Each term counts where its linear is in
    float8 (`Layout.float8_linears`)."""
    T, h, t, A = layout.tokens(seq_len), model.d_model, layout.tp, DTYPE_BYTES[layout.precision]
    column = T * h * (1 - A * (1 / t if layout.sp else 1))
    change = {
        "qkv": column,
        "proj": T * h / t * (1 if layout.recompute == "none" else 1 - A),
        "up": 0.0 if moe else column,
        "down": 0.0 if moe else -(A - 1) * T * model.ffn_dim / t,
    }
    return sum(change[n] for n in layout.float8_linears(model))


def moe_mlp_bytes(model: GPTConfig, seq_len: int, layout: Layout) -> float:
    """Bytes an MoE MLP keeps for backward per micro-batch beyond its input (the module
    docstring's router, experts and shared experts)."""
    moe, A, t = model.moe, DTYPE_BYTES[layout.precision], layout.tp
    h, G, capped = model.d_model, 2 if moe.swiglu else 1, moe.capacity_factor is not None
    tokens = layout.tokens(seq_len)
    routed = tokens / t if layout.sp else tokens
    slots = tokens * moe.top_k
    rows = slots * (moe.capacity_factor or 1)
    router = (4 * h + 8 * moe.experts + 12 * moe.top_k + 8) * routed + 4 * h * moe.experts * (A < 4)
    experts = A * h * (3 * slots + rows * capped) + A * slots + 2 * G * A * rows * moe.d_ff / t
    indices = (32 if capped else 24) * slots
    shared = (2 * G * A * tokens * moe.shared_d_ff / t + A * h * routed * (A < 4)) if moe.shared_d_ff else 0.0
    return router + experts + indices + shared


def kv_block_bytes(model: GPTConfig, seq_len: int, layout: Layout) -> float:
    """Bytes of one K/V block that a context-parallel ring passes on per step: the keys and
    values of a rank's s/cp tokens for its h/t of the model width, 2A·b·(s/cp)·h/t (hybrid:
    s/(cp/cp_a2a) tokens of h/(t·cp_a2a), the same bytes)."""
    return 2 * DTYPE_BYTES[layout.precision] * layout.tokens(seq_len) * model.d_model / layout.tp


def ring_kv_bytes(model: GPTConfig, seq_len: int, layout: Layout) -> float:
    """What a context-parallel ring holds beyond the saved activations while a layer's
    attention runs: the K/V block it computes on and the one arriving, 2 × `kv_block_bytes`
    (0 without a ring)."""
    return 2 * kv_block_bytes(model, seq_len, layout) if layout.cp_ring_size > 1 else 0.0


def chunk_activation_bytes(model: GPTConfig, seq_len: int, layout: Layout, recompute: Recompute | None = None) -> float:
    """Bytes the fullest chunk's layers keep per micro-batch: L/(p·v) layers, as many of them
    MoE layers as the chunk with the most holds."""
    n = model.n_layers // (layout.pp * layout.virtual_stages)
    dense = layer_activation_bytes(model, seq_len, layout, recompute)
    if not model.moe_experts:
        return n * dense
    most = max(sum(map(model.is_moe, range(c * n, (c + 1) * n))) for c in range(model.n_layers // n))
    return (n - most) * dense + most * layer_activation_bytes(model, seq_len, layout, recompute, moe=True)


def in_flight(schedule_name: str, pp: int, pp_rank: int, micro_batches: int, virtual_stages: int) -> int:
    """Peak (micro-batch, chunk) pairs whose forward ran and backward did not, on `pp_rank`:
    the repo's schedule's own count (`schedules.register`'s `in_flight`)."""
    validate_schedule(schedule_name, pp, micro_batches, virtual_stages)
    return SCHEDULES[schedule_name].in_flight(pp, pp_rank, micro_batches, virtual_stages)


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

    def plus(self, activations: float) -> Memory:
        """This memory with `activations` bytes more (less, when negative) held in flight."""
        return (
            Memory(self.pp_rank, self.model_states, self.activations + activations, self.buffers)
            if activations
            else self
        )


def _rank_memory(model: GPTConfig, layout: Layout, seq_len: int, pp_rank: int, gpus_per_node: int) -> Memory:
    T, h, t = layout.tokens(seq_len), model.d_model, layout.tp
    p, v, m = layout.pp, layout.virtual_stages, layout.micro_batches
    states = predict_model_states(model, layout, pp_rank)
    acts = in_flight(layout.schedule, p, pp_rank, m, v) * chunk_activation_bytes(model, seq_len, layout)
    if layout.recompute == "full":
        acts += layer_activation_bytes(model, seq_len, layout, "none", moe=bool(model.moe_experts))
    acts += ring_kv_bytes(model, seq_len, layout)
    if pp_rank == p - 1:
        at_head = m if layout.schedule == "gpipe" else 1
        acts += at_head * 4 * T * h / t * (1 + model.padded_vocab / h)
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
