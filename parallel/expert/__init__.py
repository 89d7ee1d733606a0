"""Expert parallelism (GShard, Lepikhin et al. 2021): the experts of a Mixture-of-Experts
layer split over the ranks of an expert-parallel group, tokens exchanged by all-to-all.

- ``dispatch``: `TokenDispatcher`, routed tokens to their experts' ranks and back.
- ``grouped``: `grouped_mm`, every local expert's rows times its weights in one GEMM.
- ``groups``: `ExpertGroups`, the process groups of an MoE layer.
- ``aux_loss``: the auxiliary losses of a pipeline chunk without the loss, joined to its backward.
"""

from parallel.expert.dispatch import TokenDispatcher, all_to_all
from parallel.expert.grouped import grouped_mm
from parallel.expert.groups import ExpertGroups

__all__ = ["ExpertGroups", "TokenDispatcher", "all_to_all", "grouped_mm"]
