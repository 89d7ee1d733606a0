"""Ulysses (Jacobs et al. 2023): an all-to-all turns sequence-sharded attention inputs into
head-sharded ones over the whole (group's) sequence, and a second turns the output back.

Over a group of a ranks, each holding [.., H, s, d] (H heads, its s tokens):

    heads(x)     [.., H, s, d]   -> [.., H/a, a·s, d]   rank j gets heads [j·H/a, (j+1)·H/a)
                                                         of every rank's tokens, in rank order
    sequence(y)  [.., H/a, a·s, d] -> [.., H, s, d]     the inverse

Each is the other's backward. Tokens come out in rank order, which `chunks.positions` makes
the order of the sequence (rank i of the group holds its i-th contiguous piece).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import functional

Group = dist.ProcessGroup


def _to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    a = dist.get_world_size(group)
    *lead, heads, s, d = x.shape
    parts = x.reshape(*lead, a, heads // a, s, d).movedim(-4, 0).contiguous()  # [a, .., H/a, s, d]
    received = functional.all_to_all(parts, group.group_name)  # received[j]: rank j's tokens, my heads
    return received.movedim(0, -3).reshape(*lead, heads // a, a * s, d)


def _to_sequence(y: torch.Tensor, group: Group) -> torch.Tensor:
    a = dist.get_world_size(group)
    *lead, heads, s, d = y.shape
    parts = y.reshape(*lead, heads, a, s // a, d).movedim(-3, 0).contiguous()  # [a, .., H/a, s/a, d]
    received = functional.all_to_all(parts, group.group_name)  # received[j]: my tokens, rank j's heads
    return received.movedim(0, -4).reshape(*lead, heads * a, s // a, d)


class _Heads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return _to_heads(x, group)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        return _to_sequence(dy.contiguous(), ctx.group), None


class _Sequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):  # type: ignore[override]
        ctx.group = group
        return _to_sequence(y, group)

    @staticmethod
    def backward(ctx, dx):  # type: ignore[override]
        return _to_heads(dx.contiguous(), ctx.group), None


def heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sequence-sharded [.., H, s, d] to head-sharded [.., H/a, a·s, d] (differentiable)."""
    return _Heads.apply(x, group)


def sequence(y: torch.Tensor, group: Group) -> torch.Tensor:
    """Head-sharded [.., H/a, a·s, d] back to sequence-sharded [.., H, s, d] (differentiable)."""
    return _Sequence.apply(y, group)
