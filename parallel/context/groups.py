"""The process groups of context parallelism and the attention they run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.context import all_to_all
from parallel.context.chunks import positions
from parallel.context.ring import ring_attention

Group = dist.ProcessGroup | None
LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class ContextGroups:
    """What a context-parallel attention communicates over (`parallel.ParallelDims.context`
    makes them).

    Attributes:
        cp: all the ranks sharing one sequence (None: context parallelism off).
        a2a: the ranks exchanging heads by all-to-all (None: none, the ring alone).
        ring: the ranks passing keys and values around (None: none, all-to-all alone).
    """

    cp: Group = None
    a2a: Group = None
    ring: Group = None

    @property
    def size(self) -> int:
        return _size(self.cp)

    @property
    def mode(self) -> str:
        """ring, all-to-all or hybrid (both): the name of `--cp-mode`."""
        if self.a2a is None:
            return "ring"
        return "all-to-all" if self.ring is None else "hybrid"

    def positions(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """The positions in a sequence of `seq_len` tokens of the tokens this rank holds."""
        ring, a2a = _size(self.ring), _size(self.a2a)
        return positions(seq_len, ring, _rank(self.ring), a2a, _rank(self.a2a)).to(device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x` (whole sequences along `dim`, e.g. ids and labels [b, s])."""
        return x.index_select(dim, self.positions(x.shape[dim], x.device))

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, local: LocalAttention
    ) -> torch.Tensor:
        """Causal attention [b, H, s/cp, d] of this rank's tokens over the whole sequence:
        heads gathered by all-to-all inside `a2a`, then the ring over `ring`, or `local` (the
        model's own single-device attention, on whole sequences) without a ring."""
        if self.a2a is not None:
            q, k, v = all_to_all.heads(torch.stack((q, k, v)), self.a2a).unbind(0)
        out = ring_attention(q, k, v, self.ring, window) if self.ring is not None else local(q, k, v)
        return all_to_all.sequence(out, self.a2a) if self.a2a is not None else out
