"""Context parallelism: each sequence split over the cp ranks, which hold the same
parameters; attention, the one operation that mixes tokens, runs across them.

- ``chunks``: which tokens each rank holds (the load-balanced zigzag) and which attention
  blocks the causal mask and a sliding window leave.
- ``kernels``: one block's attention with its log-sum-exp, its backward, and the merge.
- ``ring``: `ring_attention`, keys and values passed around the ring, overlapped.
- ``all_to_all``: Ulysses' sequence-to-heads all-to-all and back.
- ``groups``: `ContextGroups`, the groups of a layout and the attention they run.
"""

from parallel.context.all_to_all import heads, sequence
from parallel.context.chunks import positions
from parallel.context.groups import ContextGroups
from parallel.context.ring import ring_attention

__all__ = ["ContextGroups", "heads", "positions", "ring_attention", "sequence"]
