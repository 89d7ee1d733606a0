"""What a ZeRO stage shards over the data-parallel group (Rajbhandari et al. 2020), named.

    ZeRO stage  policy                   optimizer state  gradients  parameters
    0           REPLICATED (plain DP)    whole            whole      whole
    1           SHARD_OPTIMIZER_STATE    1/N              whole      whole
    2           SHARD_GRADIENTS          1/N              1/N        whole
    3           SHARD_PARAMETERS         1/N              1/N        1/N (gathered on use)

The code asks the policy what is sharded rather than comparing stage numbers. A stage-3
optimizer keeps its small "resident" units gathered: their buckets follow SHARD_GRADIENTS.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sharding:
    """Which model states are split 1/N over the data-parallel ranks."""

    optimizer_state: bool
    gradients: bool
    parameters: bool

    @staticmethod
    def of_zero_stage(stage: int) -> Sharding:
        return POLICIES[stage]


REPLICATED = Sharding(optimizer_state=False, gradients=False, parameters=False)
SHARD_OPTIMIZER_STATE = Sharding(optimizer_state=True, gradients=False, parameters=False)
SHARD_GRADIENTS = Sharding(optimizer_state=True, gradients=True, parameters=False)
SHARD_PARAMETERS = Sharding(optimizer_state=True, gradients=True, parameters=True)
POLICIES = (REPLICATED, SHARD_OPTIMIZER_STATE, SHARD_GRADIENTS, SHARD_PARAMETERS)
