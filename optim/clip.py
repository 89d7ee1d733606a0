"""Global gradient norm over sharded gradients, counting replicated parameters once.

    ‖g‖ = sqrt( Σ_ranks Σ_{owned elements e} w_e · g_e² )

Every element of every bucket is owned by exactly one data-parallel rank (its shard),
so summing each rank's owned part over the data-parallel group counts it once. Across
model-parallel ranks (tensor / pipeline) each rank holds different parameters, except
those marked replicated with `parallel.comm.mark_replicated(module, name, group)` (norms
and row-parallel biases under TP, tied embeddings across pipeline stages): their bucket
counts only on the rank that is rank 0 of every group it is replicated over (w_e ∈ {0, 1}).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from optim.buffers import FlatBucket
from parallel import comm


def counts_in_norm(bucket: FlatBucket) -> bool:
    """Whether this rank's copy of the bucket's (equally marked) parameters enters the norm."""
    return all(dist.get_rank(g) == 0 for g in bucket.marks.replicated)


def owned_grad(bucket: FlatBucket) -> torch.Tensor:
    """This rank's owned part of the reduced gradient (stage 0 holds all of it)."""
    if not bucket.sharding.optimizer_state:
        lo, hi = bucket.shard_range
        return bucket.grad_shard[lo:hi]
    return bucket.grad_shard


def global_grad_norm(
    buckets: list[FlatBucket],
    groups: list[dist.ProcessGroup | None],
    multiplier: float = 1.0,
) -> torch.Tensor:
    """‖multiplier · g‖₂ over all ranks of `groups` (summed over each group in turn), fp32.

    Non-finite gradients give a non-finite norm on every rank, which is how an fp16
    overflow on any one rank is seen by all of them.
    """
    device = buckets[0].grad_shard.device if buckets else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for bucket in buckets:
        if counts_in_norm(bucket):
            sq += torch.linalg.vector_norm(owned_grad(bucket), dtype=torch.float32).double() ** 2
    for group in groups:
        comm.all_reduce(sq, group=group)
    return (sq.sqrt() * multiplier).float()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> float:
    """min(1, max_norm / (‖g‖ + 1e-6)), as in torch.nn.utils.clip_grad_norm_."""
    return min(1.0, max_norm / (float(norm) + 1e-6))
