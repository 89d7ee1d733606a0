"""The process groups of a Mixture-of-Experts layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

Group = dist.ProcessGroup | None


@dataclass(frozen=True)
class ExpertGroups:
    """What an MoE layer communicates over (`parallel.ParallelDims.expert_groups` makes them).

    Attributes:
        ep: the ranks that split the experts and exchange tokens (None: this rank alone
            holds every expert).
        dp: every data-parallel rank of this model slice: the tokens whose statistics the
            auxiliary losses share (None: this rank alone).
        shard: the data-parallel ranks holding this rank's experts, over which ZeRO shards
            and reduces them (`parallel.marks.mark_expert`); needed with `ep`.
        replicate: hybrid sharding: the ranks holding the same expert shard in other replicas.
    """

    ep: Group = None
    dp: Group = None
    shard: Group = None
    replicate: Group = None

    def __post_init__(self) -> None:
        if self.ep is not None and self.shard is None:
            raise ValueError(
                "ExpertGroups(ep=...) needs shard=, the ranks holding the same experts, or a data-parallel "
                "optimizer would average different experts; ParallelDims(ep=...).build().expert_groups gives both"
            )
