"""Ring attention (Liu et al. 2023) over load-balanced chunks: each member of a ring of r
ranks holds the queries, keys and values of chunks (g, 2r−1−g) (`chunks.positions`); the
keys and values travel around the ring, r − 1 hops, each hop's send and receive in flight
while the member computes attention on the block in hand. Every query chunk meets every key
chunk once; blocks above the causal diagonal or wholly outside a sliding window are skipped,
and the partial outputs merge by their log-sum-exp (`kernels.merge`), so the result is the
single-device attention's, up to fp32 summation order.

Backward: the keys and values go around again with their gradients' running sums beside
them; each member adds its blocks' dk, dv to the sums of the chunk pair in hand before
passing them on, and after the last hop the sums reach their owner.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from parallel import comm
from parallel.context import kernels
from parallel.context.chunks import Block, block_kind, block_mask, ring_chunks

Group = dist.ProcessGroup


class _Exchange:
    """One hop of the ring in flight: `tensor` sent to the next member while a buffer of
    its shape is received from the previous one; `wait()` returns what arrived."""

    def __init__(self, tensor: torch.Tensor, group: Group) -> None:
        r, g = dist.get_world_size(group), dist.get_rank(group)
        self.received = torch.empty_like(tensor)
        nxt, prev = dist.get_global_rank(group, (g + 1) % r), dist.get_global_rank(group, (g - 1) % r)
        self.works = comm.batch_isend_irecv(
            [dist.P2POp(dist.isend, tensor, nxt, group), dist.P2POp(dist.irecv, self.received, prev, group)]
        )

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def blocks(g: int, src: int, r: int, c: int, window: int | None) -> Iterator[tuple[int, int, Block, int, int]]:
    """(query half, key half, kind, q chunk, k chunk) of member g's queries against the keys
    of member src (chunks of c tokens), skipped blocks left out."""
    for qi, q_chunk in enumerate(ring_chunks(r, g)):
        for ki, k_chunk in enumerate(ring_chunks(r, src)):
            kind = block_kind(q_chunk, k_chunk, c, window)
            if kind is not Block.SKIP:
                yield qi, ki, kind, q_chunk, k_chunk


def _half(x: torch.Tensor, i: int) -> torch.Tensor:
    c = x.shape[-2] // 2
    return x[..., i * c : (i + 1) * c, :]


Merged = list[tuple[torch.Tensor | None, torch.Tensor | None]]


def hop_forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    g: int,
    src: int,
    r: int,
    window: int | None,
    merged: Merged,
    saved: kernels.Saved,
) -> None:
    """Member g's queries q [b, H, 2c, d] against member src's keys and values kv [2, b, H,
    2c, d]: each block computed and merged into `merged` (per query half: out, lse)."""
    c = q.shape[-2] // 2
    for qi, ki, kind, q_chunk, k_chunk in blocks(g, src, r, c, window):
        mask = block_mask(q_chunk, k_chunk, c, window, q.device) if kind is Block.MASKED else None
        out, lse = kernels.forward(_half(q, qi), _half(kv[0], ki), _half(kv[1], ki), kind, mask, saved)
        merged[qi] = kernels.merge(*merged[qi], out, lse)


def hop_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    g: int,
    src: int,
    r: int,
    window: int | None,
    dq: torch.Tensor,
    dkv: torch.Tensor,
    saved: kernels.Saved,
) -> None:
    """The gradients of `hop_forward`'s blocks, given the merged `out` and `lse`: added to dq
    and to dkv (src's keys and values)."""
    c = q.shape[-2] // 2
    for qi, ki, kind, q_chunk, k_chunk in blocks(g, src, r, c, window):
        mask = block_mask(q_chunk, k_chunk, c, window, q.device) if kind is Block.MASKED else None
        halves = (_half(dout, qi), _half(q, qi), _half(kv[0], ki), _half(kv[1], ki), _half(out, qi))
        dq_, dk_, dv_ = kernels.backward(*halves, lse.chunk(2, dim=-1)[qi], kind, mask, saved)
        _half(dq, qi).add_(dq_)
        _half(dkv[0], ki).add_(dk_)
        _half(dkv[1], ki).add_(dv_)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, window):  # type: ignore[override]
        r, g = dist.get_world_size(group), dist.get_rank(group)
        kv = torch.stack((k, v)).contiguous()
        saved = kernels.Saved()
        merged: Merged = [(None, None), (None, None)]
        for hop in range(r):
            src = (g - hop) % r
            exchange = _Exchange(kv, group) if hop < r - 1 else None
            hop_forward(q, kv, g, src, r, window, merged, saved)
            if exchange is not None:
                kv = exchange.wait()
        out = torch.cat([o for o, _ in merged], dim=-2).to(q.dtype)
        lse = torch.cat([lse for _, lse in merged], dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.window, ctx.saved = group, window, saved
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group, window = ctx.group, ctx.window
        r, g = dist.get_world_size(group), dist.get_rank(group)
        dout = dout.contiguous()
        acc = kernels.accumulator(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        sums: _Exchange | None = None  # the running dk, dv of the pair in hand, arriving
        for hop in range(r):
            src = (g - hop) % r
            exchange = _Exchange(kv, group) if hop < r - 1 else None
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            hop_backward(dout, q, kv, out, lse, g, src, r, window, dq, dkv, ctx.saved)
            if sums is not None:
                dkv += sums.wait()
            if r > 1:
                sums = _Exchange(dkv, group)  # to the next member, which holds this pair next
            if exchange is not None:
                kv = exchange.wait()
        if sums is not None:
            dkv = sums.wait()  # the sums of this member's own pair, back from its last holder
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def member_in_one_process(
    q: torch.Tensor, dout: torch.Tensor, kvs: list[torch.Tensor], g: int, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Ring member g's work with every member's keys and values in hand (`kvs[src]`, [2, b, H,
    2c, d]), as `ring_attention` computes it without sending: its blocks forward and merged,
    then backward from `dout`. Returns (out, dq, the gradient of each member's keys and
    values); for measurements and tests of one member's share."""
    r = len(kvs)
    saved, merged = kernels.Saved(), [(None, None), (None, None)]
    for src in range(r):
        hop_forward(q, kvs[src], g, src, r, window, merged, saved)
    out = torch.cat([o for o, _ in merged], dim=-2).to(q.dtype)
    lse = torch.cat([lse for _, lse in merged], dim=-1)
    acc = kernels.accumulator(q.dtype)
    dq, dkvs = torch.zeros_like(q, dtype=acc), [torch.zeros_like(kv, dtype=acc) for kv in kvs]
    for src in range(r):
        hop_backward(dout, q, kvs[src], out, lse, g, src, r, window, dq, dkvs[src], saved)
    return out, dq, dkvs


@torch.compiler.disable  # isend / irecv in flight during each block's kernels: eager, between graphs
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, window: int | None = None
) -> torch.Tensor:
    """Causal softmax(q kᵀ/√d) v over the whole sequence of the ring's `group`, for this
    member's queries, keys and values [b, H, 2c, d] of chunks (g, 2r−1−g); a sliding
    `window` (tokens) restricts each query to the last `window` keys."""
    return _RingAttention.apply(q, k, v, group, window)
