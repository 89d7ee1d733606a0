"""GPT decoder built from tensor-parallel layers; tp = 1 gives the plain single-device model.

Legend: b = batch, s = sequence, h = d_model, H = heads (this rank's H/tp under TP),
d = head dim, f = d_ff, v = padded vocabulary. Activations run sequence-first, x_sbh;
under sequence parallelism (SP) the residual stream is split along s: x_(s/tp)bh.

Per block (Shoeybi et al. 2019): attention QKV is column-parallel (heads split across TP
ranks) and its output projection row-parallel; the MLP is column then row. Without SP,
each column layer's input passes f (identity / all-reduce in backward) and each row
layer's output g (all-reduce / identity): 2 all-reduces forward, 2 backward per block.
With SP (Korthikanti et al. 2022) these become all-gather / reduce-scatter pairs and the
norms, dropout and residual adds run on sequence shards.

Under context parallelism (`parallel.context`) each rank holds s/cp tokens of every sequence
(ids and labels both, the labels shifted before the split), at its true positions (learned
and rotary ones alike); attention alone mixes tokens and runs across the cp ranks, and SP
shards the rank's s/cp tokens further. The loss of a cp rank is cp · (its tokens' summed
cross-entropy) / (the valid tokens of the whole sequences), so that the mean over the cp
ranks, which the optimizer takes with the data-parallel mean, is one process's loss.

Fused weights are laid out so that any contiguous chunk of rows is a whole unit:
QKV rows as (head, {q,k,v}, d) and the SwiGLU input rows as (f, {gate, up}). So every
TP rank's row slice of the tp=1 weight holds whole heads / matched gate-up pairs.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils.checkpoint import checkpoint

from parallel import comm, marks
from parallel.context import ContextGroups
from parallel.expert.aux_loss import attach as attach_aux_loss
from parallel.expert.groups import ExpertGroups
from parallel.pipeline.partition import layer_ranges
from parallel.pipeline.schedules import stage_of
from parallel.random import get_rng_tracker
from parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    fp8,
    gather_from_sp,
    sequence_parallel_grad_sync,
    shard_of,
    vocab_parallel_cross_entropy,
)
from parallel.tensor.mappings import tp_size
from research.moe import MoE, MoEConfig

IGNORE_INDEX = -100


@dataclass
class GPTConfig:
    """Model shape and options; `d_ff` None means 4·d_model (GELU) or 8/3·d_model rounded
    up to a multiple of 64 (SwiGLU, same parameter count). The weights depend on
    `init_seed` alone (see `GPT`)."""

    vocab_size: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 128
    d_ff: int | None = None
    max_seq_len: int = 256
    position: Literal["learned", "rope"] = "learned"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    activation: Literal["gelu", "swiglu"] = "gelu"
    tie_embeddings: bool = True
    dropout: float = 0.0
    sliding_window: int | None = None
    bias: bool = True
    qkv_bias: bool = False
    vocab_multiple: int = 128
    recompute: Literal["none", "selective", "full"] = "none"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_seed: int = 0
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_d_ff: int | None = None
    moe_shared_experts: int = 0
    moe_capacity_factor: float | None = None
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.001
    moe_renormalize: bool = True
    fp8: Literal["none", "tensorwise"] = "none"
    fp8_filter: Literal["auto", "none"] = "auto"

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        choices = {
            "position": ("learned", "rope"),
            "norm": ("layernorm", "rmsnorm"),
            "activation": ("gelu", "swiglu"),
            "recompute": ("none", "selective", "full"),
            "fp8": ("none", "tensorwise"),
            "fp8_filter": ("auto", "none"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dim, got d_model/n_heads={self.head_dim}")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"--moe-top-k={self.moe_top_k} must be between 1 and --moe-experts={self.moe_experts}")

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has an MoE MLP: every `moe_every`-th block."""
        return self.moe_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def moe(self) -> MoEConfig:
        """The MoE layers' shape and losses (expert width `moe_d_ff`, default the dense
        MLP's; the shared experts together are `moe_shared_experts` experts wide)."""
        d_ff = self.moe_d_ff or self.ffn_dim
        return MoEConfig(
            d_model=self.d_model,
            experts=self.moe_experts,
            top_k=self.moe_top_k,
            d_ff=d_ff,
            swiglu=self.activation == "swiglu",
            shared_d_ff=self.moe_shared_experts * d_ff,
            capacity_factor=self.moe_capacity_factor,
            aux_loss_coeff=self.moe_aux_loss_coeff,
            z_loss_coeff=self.moe_z_loss_coeff,
            renormalize=self.moe_renormalize,
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.activation == "swiglu":
            return math.ceil(8 * self.d_model / 3 / 64) * 64
        return 4 * self.d_model

    @property
    def padded_vocab(self) -> int:
        """Vocabulary rounded up to `vocab_multiple` (independent of tp, so the same seed
        gives the same embedding at every tp; tp must divide it)."""
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple

    def with_vocab_of(self, tokenizer_vocab: int) -> GPTConfig:
        """This config with its vocabulary raised to the tokenizer's (a run's real vocabulary)."""
        return replace(self, vocab_size=max(self.vocab_size, tokenizer_vocab))

    def linear_shapes(self, tp: int) -> dict[str, tuple[int, int]]:
        """(in, out) features of a dense block's four linears on one of tp ranks: QKV and the
        MLP's up projection split their outputs, the attention projection and the MLP's down
        projection their inputs."""
        h, f = self.d_model, self.ffn_dim
        up = 2 * f if self.activation == "swiglu" else f
        return {"qkv": (h, 3 * h // tp), "proj": (h // tp, h), "up": (h, up // tp), "down": (f // tp, h)}

    def float8_linears(self, tp: int) -> frozenset[str]:
        """The linears of `linear_shapes` that run in float8 when it is on: with `fp8_filter`
        "auto" those whose local shape `fp8.pays`, with "none" all four (an MoE layer's experts
        and the head never)."""
        shapes = self.linear_shapes(tp)
        return frozenset(n for n, (i, o) in shapes.items() if self.fp8_filter == "none" or fp8.pays(i, o))

    def fp8_recipe(self, linear: str, tp: int) -> str:
        """The float8 recipe of one of `linear_shapes`' linears: `fp8`, or "none" where it stays in bf16."""
        return self.fp8 if linear in self.float8_linears(tp) else "none"

    def validate_tp(self, tp: int) -> None:
        """One sentence per layout this model cannot be split into."""
        for name, value in (("n_heads", self.n_heads), ("ffn_dim", self.ffn_dim), ("padded vocab", self.padded_vocab)):
            if value % tp:
                raise ValueError(f"{name}={value} is not divisible by tp={tp}")

    def forward_flops_per_token(self, seq_len: int) -> tuple[float, float, float]:
        """(one dense layer, its attention core, the head): forward matmul FLOPs per token.
        Per layer: QKV 6h², scores and weighted sum 4·s·h (full causal square, as in Narayanan
        et al. 2021), projection 2h², MLP 2·h·f per matrix (3 with SwiGLU); head 2·h·v."""
        h = self.d_model
        core = 4 * seq_len * h
        return 8 * h * h + core + self._mlp_flops(self.ffn_dim), core, 2 * h * self.padded_vocab

    def _mlp_flops(self, width: int) -> float:
        return (3 if self.activation == "swiglu" else 2) * 2 * self.d_model * width

    def moe_layer_extra_flops(self) -> float:
        """Forward FLOPs per token of an MoE layer beyond a dense one: the router 2·h·E, k
        experts and the shared ones in place of the dense MLP (the active path only)."""
        moe = self.moe
        active = self._mlp_flops(moe.top_k * moe.d_ff + moe.shared_d_ff)
        return 2 * self.d_model * moe.experts + active - self._mlp_flops(self.ffn_dim)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (of the active path): 3 × the forward matmuls of the
        layers and the head (forward + 2 for backward), plus one more forward of the layers
        under full recompute (of their attention core under selective)."""
        layer, core, head = self.forward_flops_per_token(seq_len)
        moe_layers = sum(map(self.is_moe, range(self.n_layers)))
        layers = self.n_layers * layer + moe_layers * self.moe_layer_extra_flops()
        extra = {"none": 0, "selective": self.n_layers * core, "full": layers}[self.recompute]
        return 3 * (layers + head) + extra


class Norm(nn.Module):
    """LayerNorm or RMSNorm, replicated across TP ranks (marked so clipping counts it once;
    under SP its gradient is summed over the TP group)."""

    def __init__(self, config: GPTConfig, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
        super().__init__()
        self.eps, self.rms = config.norm_eps, config.norm == "rmsnorm"
        h = config.d_model
        self.weight = nn.Parameter(torch.ones(h))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(h))
        for name, _ in self.named_parameters():
            _mark_replicated(self, name, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


@contextlib.contextmanager
def _part_rng(config: GPTConfig, part: str) -> Iterator[None]:
    """The global CPU RNG seeded by (init_seed, part) inside, restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.init_seed * 1_000_003 + zlib.crc32(part.encode()))
        yield


def _mark_replicated(module: nn.Module, name: str, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
    if sequence_parallel:
        sequence_parallel_grad_sync(module, name, group)
    else:
        marks.mark_replicated(module, name, group)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [s, d/2] of the rotary angles pos · θ^(−2i/d)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


class _Rope(torch.autograd.Function):
    """q and k of every head rotated by the position's angle θ, v copied: one new tensor, so
    attention keeps it in place of the QKV output. A rotation's adjoint is the rotation by
    -θ: the backward needs only cos and sin (the model's shared tables), no activation."""

    @staticmethod
    def forward(ctx, qkv_sbX, cos_sd, sin_sd, heads):
        ctx.save_for_backward(cos_sd, sin_sd)
        ctx.heads = heads
        return _rotate_qk(qkv_sbX, cos_sd, sin_sd, heads)

    @staticmethod
    def backward(ctx, d_sbX):
        cos_sd, sin_sd = ctx.saved_tensors
        return _rotate_qk(d_sbX, cos_sd, -sin_sd, ctx.heads), None, None, None


def _rotate_qk(qkv_sbX: torch.Tensor, cos_sd: torch.Tensor, sin_sd: torch.Tensor, heads: int) -> torch.Tensor:
    """Channel pairs (x₁, x₂) = (even, odd) of q and k to (x₁cos - x₂sin, x₁sin + x₂cos),
    in x's dtype; rows of qkv as (head, {q, k, v}, d)."""
    out = torch.empty_like(qkv_sbX, memory_format=torch.contiguous_format)
    x = qkv_sbX.unflatten(-1, (heads, 3, -1))
    y = out.view_as(x)
    x1, x2 = x[..., :2, 0::2], x[..., :2, 1::2]
    cos, sin = (t.to(x.dtype)[:, None, None, None] for t in (cos_sd, sin_sd))
    y[..., :2, :] = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    y[..., 2, :] = x[..., 2, :]
    return out


def apply_rope(qkv_sbX: torch.Tensor, cos_sd: torch.Tensor, sin_sd: torch.Tensor, heads: int) -> torch.Tensor:
    """RoPE (Su et al. 2021) on the QKV output [s, b, H·3·d]: q and k of each of the `heads`
    rotated by pos · θ^(-2i/d) (cos, sin [s, d/2]), v as is; the backward keeps no activation."""
    return _Rope.apply(qkv_sbX, cos_sd, sin_sd, heads)


def _dropout(x: torch.Tensor, p: float, training: bool, per_tp_rank: bool) -> torch.Tensor:
    """Dropout keeping a 1-byte mask for backward on every device (`native_dropout`, which
    F.dropout runs on CUDA; on the CPU F.dropout keeps a mask in x's dtype); masks drawn from
    the per-TP-rank RNG where activations differ across ranks."""
    if p == 0.0 or not training:
        return x
    with get_rng_tracker().fork() if per_tp_rank else contextlib.nullcontext():
        return torch.native_dropout(x, p, True)[0]


class Attention(nn.Module):
    """Causal self-attention, heads split across TP ranks; across the cp ranks of `context`
    when it has them."""

    def __init__(
        self,
        config: GPTConfig,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        context: ContextGroups | None = None,
    ) -> None:
        super().__init__()
        h, self.config, self.context, t = config.d_model, config, context, tp_size(group)
        self.heads = config.n_heads // t
        self.qkv = ColumnParallelLinear(
            h, 3 * h, group=group, bias=config.qkv_bias, sequence_parallel=sequence_parallel,
            fp8=config.fp8_recipe("qkv", t),
        )  # fmt: skip
        self.proj = RowParallelLinear(
            h, h, group=group, bias=config.bias, sequence_parallel=sequence_parallel, fp8=config.fp8_recipe("proj", t)
        )

    def core(self, qkv_sbX: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        """softmax(q kᵀ/√d + causal mask) v for this rank's heads: [s, b, H·3·d] -> [s, b, H·d]."""
        c = self.config
        if cos is not None:
            qkv_sbX = apply_rope(qkv_sbX, cos, sin, self.heads)
        q, k, v = rearrange(qkv_sbX, "s b (H three d) -> three b H s d", H=self.heads, three=3)
        if self.context is None:
            out = self._local(q, k, v)
        else:
            if self.context.ring is not None and c.dropout and self.training:
                raise ValueError(
                    f"--cp-mode {self.context.mode} cannot drop attention weights (--dropout={c.dropout}): "
                    "use --cp-mode all-to-all, or --dropout 0"
                )
            out = self.context.attention(q, k, v, c.sliding_window, self._local)
        return rearrange(out, "b H s d -> s b (H d)")

    def _local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q kᵀ/√d + mask) v on whole sequences [b, H, s, d], with dropout."""
        c = self.config
        drop = c.dropout if self.training else 0.0
        if c.sliding_window is None:
            with get_rng_tracker().fork() if drop else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        else:
            s = q.shape[-2]
            i = torch.arange(s, device=q.device)
            allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < c.sliding_window)
            with get_rng_tracker().fork() if drop else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=drop)
        return out

    def forward(self, x_sbh: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        qkv = self.qkv(x_sbh)
        if self.config.recompute == "selective":
            out = checkpoint(self.core, qkv, cos, sin, use_reentrant=False)
        else:
            out = self.core(qkv, cos, sin)
        return self.proj(out)


class MLP(nn.Module):
    """Column-parallel up projection (GELU, or SwiGLU with (f, {gate, up}) rows), then
    row-parallel down projection."""

    def __init__(self, config: GPTConfig, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
        super().__init__()
        h, f = config.d_model, config.ffn_dim
        self.swiglu = config.activation == "swiglu"
        width = 2 * f if self.swiglu else f
        t = tp_size(group)
        self.up = ColumnParallelLinear(
            h, width, group=group, bias=config.bias, sequence_parallel=sequence_parallel, fp8=config.fp8_recipe("up", t)
        )
        self.down = RowParallelLinear(
            f, h, group=group, bias=config.bias, sequence_parallel=sequence_parallel, fp8=config.fp8_recipe("down", t)
        )

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        u = self.up(x_sbh)
        if self.swiglu:
            gate, up = rearrange(u, "s b (f two) -> two s b f", two=2)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(u))


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)), dropout on each branch. The
    MLP of an MoE block (`moe` given) is `research.moe.MoE`, with always-on shared experts
    as a dense MLP beside it."""

    def __init__(
        self,
        config: GPTConfig,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        moe: ExpertGroups | None = None,
        context: ContextGroups | None = None,
    ) -> None:
        super().__init__()
        self.config, self.sp = config, sequence_parallel
        self.norm1 = Norm(config, group, sequence_parallel)
        self.attn = Attention(config, group, sequence_parallel, context)
        self.norm2 = Norm(config, group, sequence_parallel)
        self.is_moe = moe is not None
        if moe is None:
            self.mlp = MLP(config, group, sequence_parallel)
        else:
            shared_d_ff = config.moe.shared_d_ff
            shared = MLP(replace(config, d_ff=shared_d_ff), group, sequence_parallel) if shared_d_ff else None
            self.mlp = MoE(config.moe, group, sequence_parallel, moe, shared)

    def _forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        p, train = self.config.dropout, self.training
        x = x + _dropout(self.attn(self.norm1(x), cos, sin), p, train, self.sp)
        out, aux = self.mlp(self.norm2(x)) if self.is_moe else (self.mlp(self.norm2(x)), None)
        return x + _dropout(out, p, train, self.sp), aux

    def compile_computation(self, fullgraph: bool = False) -> None:
        """Compile the block's computation (`_forward`) with torch.compile, inside its module
        hooks and its full-recompute checkpoint: a ZeRO-3 gather around the block stays outside
        the graph, and recompute replays the compiled graph."""
        self._forward = torch.compile(self._forward, fullgraph=fullgraph)

    def forward(
        self, x_sbh: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's output and, for an MoE block, its auxiliary losses (else None)."""
        if self.config.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x_sbh, cos, sin, use_reentrant=False)
        return self._forward(x_sbh, cos, sin)


class TiedHead(nn.Module):
    """The output projection by the embedding's own weight E (held here too, as in
    nanoGPT, so that the module using it is the one that holds it): logits = x Eᵀ, this
    rank's vocabulary shard; x enters through f, or is gathered along s under SP."""

    def __init__(self, weight: nn.Parameter, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight, self.group, self.sp = weight, group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sp(x, self.group) if self.sp else copy_to_tp(x, self.group)
        return F.linear(x, self.weight)


class GPT(nn.Module):
    """GPT decoder. `model(input_ids_bs, labels_bs)` returns the mean token cross-entropy
    (a scalar, the same on every TP rank; labels equal to -100 are ignored) plus the
    auxiliary losses of its MoE blocks (`research.moe`); `model(input_ids_bs)` returns logits
    [b, s, v/tp] (this rank's vocabulary shard). With `expert_groups`
    (`ParallelDims.expert_groups`) the MoE blocks split their experts over its ep ranks; with
    `context` (`ParallelDims.context`) ids and labels are still whole sequences, as without
    it: the model keeps this rank's tokens of each (`ContextGroups.shard`), returns their
    logits [b, s/cp, v/tp], and the loss is its share (see the module docstring).

    A pipeline stage builds only `layers` (global block indices; parameter names keep
    them: `blocks.5.attn.qkv.weight`), plus the embedding when `pre` and the final norm and
    head when `post`. With tied embeddings a `post` stage without `pre` holds its own copy
    of the embedding weight, initialized identically; the pipeline keeps the two in sync.

    Each part (embedding, positions, block i, final norm, head) draws its weights at full
    size from its own RNG stream, seeded by (config.init_seed, part), and keeps its TP
    slice: the weights depend neither on the global RNG nor on which other parts exist, so
    every TP rank, and later every pipeline stage, holds exactly its slice of the tp = 1
    model's weights. Under SP the sequence length must be divisible by tp.
    """

    def __init__(
        self,
        config: GPTConfig,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        layers: range | None = None,
        pre: bool = True,
        post: bool = True,
        expert_groups: ExpertGroups | None = None,
        context: ContextGroups | None = None,
    ) -> None:
        super().__init__()
        config.validate_tp(tp_size(tp_group))
        self.config, self.group = config, tp_group
        self.context = context if context is not None and context.size > 1 else None
        self.sp = sequence_parallel and tp_size(tp_group) > 1
        self.pre, self.post = pre, post
        h = config.d_model
        self.embed = None
        if pre or (post and config.tie_embeddings):
            with _part_rng(config, "embed"):
                self.embed = VocabParallelEmbedding(config.padded_vocab, h, group=tp_group, sequence_parallel=self.sp)
        self.pos = None
        if pre and config.position == "learned":
            with _part_rng(config, "pos"):
                self.pos = nn.Parameter(torch.empty(config.max_seq_len, h))
                nn.init.normal_(self.pos, std=0.02)
            _mark_replicated(self, "pos", tp_group, self.sp)
        if config.position == "rope":
            cos, sin = rope_cos_sin(config.max_seq_len, config.head_dim, config.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.blocks = nn.ModuleDict()
        for i in layers if layers is not None else range(config.n_layers):
            with _part_rng(config, f"block{i}"):
                moe = (expert_groups or ExpertGroups()) if config.is_moe(i) else None
                self.blocks[str(i)] = Block(config, tp_group, self.sp, moe, self.context)
        self.norm = self.head = None
        if post:
            self.norm = Norm(config, tp_group, self.sp)
            if config.tie_embeddings:
                self.head = TiedHead(self.embed.weight, tp_group, self.sp)
            else:
                with _part_rng(config, "head"):
                    self.head = ColumnParallelLinear(
                        h, config.padded_vocab, group=tp_group, bias=False, sequence_parallel=self.sp
                    )

    def forward(self, inputs: torch.Tensor, labels_bs: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs`: token ids [b, s] of whole sequences when this module holds the embedding
        (pre), else the hidden states x_sbh of the previous pipeline stage (this rank's
        tokens). Returns the loss (post, with labels [b, s]), logits [b, s, v/tp] (post; under
        context parallelism of this rank's tokens), or the hidden states for the next stage."""
        cp = self.context.size if self.context is not None else 1
        if self.pre:
            s = inputs.shape[1]
            if s > self.config.max_seq_len:
                raise ValueError(f"sequence length {s} exceeds max_seq_len={self.config.max_seq_len}")
            where = self._positions(s, inputs.device)
            if self.context is not None:
                inputs = self.context.shard(inputs)
            x = self.embed(inputs.t())
            if self.pos is not None:
                pos = self.pos[where, None, :]
                x = x + (shard_of(pos, 0, self.group) if self.sp else pos).to(x.dtype)
            x = _dropout(x, self.config.dropout, self.training, self.sp)
        else:
            x = inputs
            s = x.shape[0] * (tp_size(self.group) if self.sp else 1) * cp
            where = self._positions(s, x.device)
        cos = sin = None
        if self.config.position == "rope":
            cos, sin = self.rope_cos[where], self.rope_sin[where]
        aux = []
        for block in self.blocks.values():
            x, block_aux = block(x, cos, sin)
            aux += [block_aux] if block_aux is not None else []
        if not self.post:
            return attach_aux_loss(x, sum(aux)) if aux else x
        logits_sbv = self.logits(self.norm(x))
        if labels_bs is None:
            return logits_sbv.transpose(0, 1)
        if self.context is not None:
            if labels_bs.shape[1] != s:
                raise ValueError(
                    f"labels of {labels_bs.shape[1]} tokens for sequences of {s}: under context parallelism pass "
                    "the labels of the whole sequences, as the ids (the model keeps this rank's share of both)"
                )
            labels_bs = self.context.shard(labels_bs)
        loss = self.loss(logits_sbv, labels_bs.t())
        return loss + sum(aux) if aux else loss

    def _positions(self, seq_len: int, device: torch.device) -> slice | torch.Tensor:
        """The positions of this rank's tokens in sequences of `seq_len`: all of them, or its
        context-parallel share."""
        if self.context is None:
            return slice(0, seq_len)
        return self.context.positions(seq_len, device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard of the logits, [s, b, v/tp], from the (SP-sharded)
        final hidden states."""
        return self.head(x)

    def loss(self, logits_sbv: torch.Tensor, labels_sb: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over tokens whose label is not -100 (padding of the
        vocabulary excluded); under context parallelism this rank's share × cp, the count
        summed over the cp ranks."""
        valid = labels_sb != IGNORE_INDEX
        ce = vocab_parallel_cross_entropy(
            logits_sbv, labels_sb.where(valid, 0), self.group, vocab_size=self.config.vocab_size
        )
        if self.context is None:
            return (ce * valid).sum() / valid.sum()
        count = valid.sum().to(ce.dtype)
        comm.all_reduce(count, group=self.context.cp)
        return (ce * valid).sum() * self.context.size / count


def compile_blocks(chunks: list[GPT], fullgraph: bool) -> None:
    """Regional compilation: each transformer block's computation compiled on its own
    (`Block.compile_computation`); torch.compile keys its graphs by code, so alike blocks share
    one graph and compile time does not grow with depth. Whatever the graphs cannot hold runs eagerly between them: a ZeRO-3 unit's gather
    and free, a collective of TP, experts or context parallelism; `fullgraph` asks for one
    graph per block where nothing breaks it."""
    for chunk in chunks:
        for block in chunk.blocks.values():
            block.compile_computation(fullgraph)


def pipeline_chunks(
    config: GPTConfig,
    pp_rank: int,
    pp: int,
    virtual_stages: int = 1,
    tp_group: dist.ProcessGroup | None = None,
    embedding_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    allow_uneven: bool = False,
    expert_groups: ExpertGroups | None = None,
    context: ContextGroups | None = None,
) -> list[GPT]:
    """This pipeline rank's model chunks: chunk c is virtual stage c·pp + pp_rank of the
    layers split by `layer_ranges`; the first stage holds the embedding, the last the final
    norm, head and loss. A tied embedding on two ranks is marked tied over
    `embedding_group` (its gradient is summed there); on one rank the chunks share it."""
    stages = pp * virtual_stages
    ranges = layer_ranges(config.n_layers, stages, allow_uneven)
    chunks = []
    for c in range(virtual_stages):
        stage = stage_of(pp_rank, c, pp)
        chunks.append(
            GPT(
                config,
                tp_group,
                sequence_parallel,
                layers=ranges[stage],
                pre=stage == 0,
                post=stage == stages - 1,
                expert_groups=expert_groups,
                context=context,
            )
        )
    if config.tie_embeddings and stages > 1:
        holders = [chunk for chunk in chunks if chunk.embed is not None]
        if len(holders) == 2:
            holders[1].embed = holders[0].embed
            holders[1].head.weight = holders[0].embed.weight
        elif holders:
            marks.mark_tied(holders[0].embed, "weight", embedding_group)
    return chunks
