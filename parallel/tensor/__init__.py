"""Tensor parallelism (Shoeybi et al. 2019) with sequence parallelism (Korthikanti et al. 2022).

- ``mappings``: autograd-aware collectives between replicated, TP-sharded (last dim) and
  SP-sharded (dim 0) activations: f, g and their sequence-parallel variants.
- ``layers``: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, the
  tp-independent init (``shard_of``) and the SP gradient sync of replicated parameters.
- ``cross_entropy``: the loss over vocabulary-parallel logits.
"""

from parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_init,
    sequence_parallel_grad_sync,
    shard_of,
)
from parallel.tensor.mappings import (
    ShapeGroup,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
    tp_rank,
    tp_size,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShapeGroup",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "default_init",
    "gather_from_sp",
    "gather_from_tp",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_sp",
    "scatter_to_tp",
    "sequence_parallel_grad_sync",
    "shard_of",
    "tp_rank",
    "tp_size",
    "vocab_parallel_cross_entropy",
]
