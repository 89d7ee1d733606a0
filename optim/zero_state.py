"""ZeroState: what every part of ZeroOptimizer reads, built once by it and handed to each part
(GradTracker, GradReducer, ShardStep, StateDicts, ModelStateHooks), which keeps only state of
its own beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from optim.policies import Communication, ZeroPlusPlus
from optim.sharding import Sharding

if TYPE_CHECKING:
    from optim.buffers import FlatBucket
    from optim.scaler import DynamicLossScaler


@dataclass(eq=False)
class ZeroState:
    """The model, its buckets (`optim.buffers`) and parameter names; the groups: the shard group
    (`group`, this rank's place in it), the replicas of hybrid sharding, the two node groups of
    ZeRO++ (`node_groups`: this node's ranks of the shard group, this rank's peers on the other
    nodes) and the model-parallel group; the stage and compute dtype; the policies; the fp16
    loss scaler; the inner optimizer over the fp32 master shards; and what the state dicts need
    of the model as it was given (original dtypes by id, torch's parameter order)."""

    model: torch.nn.Module
    names: dict[torch.nn.Parameter, str]
    group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    node_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]
    model_parallel_group: dist.ProcessGroup | None
    stage: int
    param_dtype: torch.dtype
    communication: Communication
    zero_plus_plus: ZeroPlusPlus
    scaler: DynamicLossScaler | None
    optimizer_class: type[torch.optim.Optimizer]
    orig_dtypes: dict[int, torch.dtype]
    torch_order: list[list[torch.nn.Parameter]]
    buckets: list[FlatBucket] = field(default_factory=list)  # filled by ZeroOptimizer's construction
    inner: torch.optim.Optimizer = None  # type: ignore[assignment]  # likewise, once the buckets exist

    @property
    def sharding(self) -> Sharding:
        return Sharding.of_zero_stage(self.stage)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def dp_groups(self) -> list[dist.ProcessGroup | None]:
        """The shard group, then the replicate group if any: together every data-parallel rank."""
        return [self.group] + ([self.replicate_group] if self.replicate_group is not None else [])

    @property
    def norm_groups(self) -> list[dist.ProcessGroup | None]:
        """What a global norm sums over: the shard group, then the model-parallel group if any."""
        return [self.group] + ([self.model_parallel_group] if self.model_parallel_group is not None else [])

    @property
    def unscale(self) -> float:
        """1 / the fp16 loss scale (1 without one): what turns the reduced gradients into ḡ."""
        return 1.0 / self.scaler.scale if self.scaler is not None else 1.0
