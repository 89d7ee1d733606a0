"""Per-GPU memory of a layout: model states, activations and buffers, for the fullest pipeline rank.

Legend in `research.costmodel`.

Model states, counted as `ZeroOptimizer.memory_breakdown` counts them (Rajbhandari et al.
2020, mixed-precision Adam: fp32 master + m + v):

    stage | params             | grads  | master (P < 4 only) | Adam m, v
      0   | PΨ                 | GΨ     | 4Ψ                  | 8Ψ
      1   | PΨ                 | GΨ     | 4Ψ/d                | 8Ψ/d
      2   | PΨ                 | GΨ/d   | 4Ψ/d                | 8Ψ/d
      3   | P(Ψ_res + Ψ_sh/d)  | GΨ/d   | 4Ψ/d                | 8Ψ/d

In fp32 the master is the parameter itself. At stage 3 a unit (`optim.stage3.stage3_units`)
smaller than `optim.zero.default_resident_numel(layout.unit_numel)` stays whole on every rank (Ψ_res). Ψ of a pipeline rank is
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

Buffers: at stages 2-3 with m > 1 and `grad_sync` last the full gradient buckets live through
the step (every backward but the last runs under `no_sync`), GΨ(1 - 1/d); with `grad_sync`
every each backward reduces its chunk as it goes, like m = 1 (the few buckets in flight
are not counted, as at m = 1); stage 3 holds two gathered units
(current and prefetched); plus `RESERVED_BYTES` (CUDA context, NCCL / cuBLAS workspaces,
allocator slack).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optim.buffers import ALIGN
from optim.zero import DEFAULT_UNIT_NUMEL, default_resident_numel
from parallel.pipeline.partition import layer_ranges
from parallel.pipeline.schedules import SCHEDULES, splits_backward, stage_of
from parallel.pipeline.schedules import validate as validate_schedule
from parallel.pipeline.simulate import peak_in_flight

from research.costmodel.hardware import GiB
from research.costmodel.layout import DTYPE_BYTES, Layout, Recompute
from research.model import GPTConfig

if TYPE_CHECKING:
    pass

RESERVED_BYTES = 2 * GiB


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
    attn = _Module(
        children=(
            linear(3 * h // t, h, 3 * h // t if model.qkv_bias else None),
            linear(h, h // t, h if model.bias else None),
        )
    )
    mlp = _Module(
        children=(
            linear(mlp_in // t, h, mlp_in // t if model.bias else None),
            linear(h, f // t, h if model.bias else None),
        )
    )
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


def unit_sizes(
    model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int, unit_numel: int = DEFAULT_UNIT_NUMEL
) -> list[tuple[int, int]]:
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
    resident: int  # aligned numel in stage-3 units below the resident size (kept whole)
    largest_units: int  # aligned numel of the two largest sharded stage-3 units (gathered at once)


_RANK_PARAMS: dict[tuple, RankParams] = {}


def rank_params(
    model: GPTConfig, tp: int, pp: int, virtual_stages: int, pp_rank: int, unit_numel: int = DEFAULT_UNIT_NUMEL
) -> RankParams:
    """`RankParams` of pipeline rank `pp_rank` (memoized)."""
    key = (*vars(model).values(), tp, pp, virtual_stages, pp_rank, unit_numel)
    if key not in _RANK_PARAMS:
        units = unit_sizes(model, tp, pp, virtual_stages, pp_rank, unit_numel)
        resident = default_resident_numel(unit_numel)
        sharded = sorted((a for raw, a in units if raw >= resident), reverse=True)
        _RANK_PARAMS[key] = RankParams(
            numel=sum(raw for raw, _ in units),
            aligned=sum(a for _, a in units),
            resident=sum(a for raw, a in units if raw < resident),
            largest_units=sum(sharded[:2]),
        )
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
    docstring), for the Trainer's ZeroOptimizer."""
    P, G, d, stage = DTYPE_BYTES[layout.precision], DTYPE_BYTES[layout.reduce_dtype], layout.dp, layout.zero
    rank = rank_params(model, layout.tp, layout.pp, layout.virtual_stages, pp_rank, layout.unit_numel)
    psi = rank.aligned
    params = P * (psi if stage < 3 else rank.resident + (psi - rank.resident) / d)
    grads = G * psi / (d if stage >= 2 else 1)
    optimized = psi / (d if stage >= 1 else 1)
    master = 4 * optimized if P < 4 else 0
    return ModelStates(params, grads, master + 8 * optimized)


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
    rank = rank_params(model, t, p, v, pp_rank, layout.unit_numel)
    if layout.zero >= 2 and m > 1 and layout.grad_sync == "last":
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
