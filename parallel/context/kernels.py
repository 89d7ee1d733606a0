"""Attention of one (query chunk, key chunk) block with its log-sum-exp, and its backward
from the merged output, so that blocks computed apart combine exactly.

For scores S = q kᵀ · scale (masked pairs −∞), a block gives

    lse = log Σ_t exp S_t,   out = Σ_t exp(S_t − lse) v_t.

Two blocks of the same queries merge as lse = logaddexp(lse₁, lse₂), out = out₁·exp(lse₁ −
lse) + out₂·exp(lse₂ − lse) (`merge`, fp32). The backward of a block needs only the final
out and lse (Dao 2023): P = exp(S − lse), dv = Pᵀ dout, dS = P ⊙ (dout vᵀ − rowsum(dout ⊙ out)),
dq = dS k · scale, dk = dSᵀ q · scale.

Fused kernels run it where they exist, never materializing the block's scores: on CUDA in
fp16 / bf16 flash for full and causal blocks and the memory-efficient kernel with an additive
mask for masked ones; on the CPU its flash kernel (any float dtype, the mask additive). A
kernel reports a row with no allowed key as lse 0, which the merge would count: such rows of
a masked block get lse −∞. Elsewhere (CUDA in fp32) the same math runs in fp32
(`_math_forward`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parallel.context.chunks import Block

aten = torch.ops.aten
LSE_ALIGN = 32  # the memory-efficient kernel pads its log-sum-exp rows to this


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are computed and merged in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def fused(q: torch.Tensor) -> bool:
    """Whether blocks of `q` run on the fused CUDA kernels (fp16 / bf16)."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


@dataclass
class Saved:
    """What a fused forward hands its backward beyond q, k, v, out and lse (the kernels' own
    bookkeeping: empty sequence offsets and an unused RNG state, with no dropout)."""

    flash: tuple | None = None
    efficient: tuple | None = None


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: Block, mask: torch.Tensor | None, saved: Saved
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, H, c, d], lse [b, H, c] fp32) of one block; `mask` [c, c] for a MASKED one."""
    if q.device.type == "cpu":
        bias = _bias(mask, q) if kind is Block.MASKED else None
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, kind is Block.CAUSAL, attn_mask=bias)
        return out, _no_key(lse, mask)
    if not fused(q):
        return _math_forward(q, k, v, kind, mask)
    if kind is Block.MASKED:
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, _bias(mask, q), True, 0.0, False)
        saved.efficient = (seed, offset, lse.shape[-1])
        return out, _no_key(lse[..., : q.shape[-2]], mask)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, kind is Block.CAUSAL
    )
    saved.flash = (cum_q, cum_k, max_q, max_k, seed, offset)
    return out, lse


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kind: Block,
    mask: torch.Tensor | None,
    saved: Saved,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the merged `out` and `lse` of its queries."""
    if q.device.type == "cpu":
        bias = _bias(mask, q) if kind is Block.MASKED else None
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(accumulator(q.dtype)), 0.0, kind is Block.CAUSAL, attn_mask=bias
        )
    if not fused(q):
        return _math_backward(dout, q, k, v, out, lse, kind, mask)
    if kind is Block.MASKED:
        seed, offset, rows = saved.efficient
        padded = torch.nn.functional.pad(lse, (0, rows - lse.shape[-1])).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, _bias(mask, q), out, padded, seed, offset, 0.0, [True, True, True, False], False
        )
        return dq, dk, dv
    cum_q, cum_k, max_q, max_k, seed, offset = saved.flash
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, kind is Block.CAUSAL, seed, offset
    )


def _no_key(lse: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`lse` with −∞ for the rows of `mask` that allow no key (a kernel reports 0 there)."""
    return lse if mask is None else lse.masked_fill(~mask.any(-1), float("-inf"))


def _bias(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The additive form of a boolean mask, broadcast to [b, H, c, c]."""
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return bias.expand(q.shape[0], q.shape[1], *mask.shape)


def _scores(q: torch.Tensor, k: torch.Tensor, kind: Block, mask: torch.Tensor | None) -> torch.Tensor:
    """S = q kᵀ / √d in the accumulator dtype, disallowed pairs −∞."""
    acc = accumulator(q.dtype)
    s = q.to(acc) @ k.to(acc).transpose(-2, -1) / math.sqrt(q.shape[-1])
    if kind is Block.CAUSAL:
        c = s.shape[-1]
        mask = torch.ones(c, c, dtype=torch.bool, device=s.device).tril()
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _math_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: Block, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, kind, mask)
    lse = s.logsumexp(-1)
    p = torch.exp(s - lse[..., None]).nan_to_num_(0.0)  # a row with no key: lse = −∞, nothing
    return p @ v.to(p.dtype), lse


def _math_backward(dout, q, k, v, out, lse, kind, mask):
    s = _scores(q, k, kind, mask)
    p = torch.exp(s - lse[..., None])
    acc = p.dtype
    dout = dout.to(acc)
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.to(acc).transpose(-2, -1) - (dout * out.to(acc)).sum(-1, keepdim=True))
    scale = 1 / math.sqrt(q.shape[-1])
    return ds @ k.to(acc) * scale, ds.transpose(-2, -1) @ q.to(acc) * scale, dv


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (out, lse) of the queries' keys so far joined with one more block's, in the
    accumulator dtype."""
    block_out = block_out.to(accumulator(block_out.dtype))
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    keep = torch.exp(lse - new).nan_to_num_(0.0)[..., None]  # −∞ − (−∞): no key on either side yet
    add = torch.exp(block_lse - new).nan_to_num_(0.0)[..., None]
    return out * keep + block_out * add, new
