"""Cross entropy over vocabulary-parallel logits (Megatron, Shoeybi et al. 2019, §3).

Rank r holds the logits of vocabulary columns [r·v/tp, (r+1)·v/tp): z_sbv (local shard).
For a token with target t, the loss  ℓ = log Σ_j exp(z_j) − z_t  needs only three
[s, b] all-reduces over the TP group, never the full [s, b, v] logits:

    m   = max_r  max_j z_j                  (all-reduce MAX, for stability)
    z_t = Σ_r  (z_t − m if t is in shard r else 0)        (all-reduce SUM)
    S   = Σ_r  Σ_j exp(z_j − m)              (all-reduce SUM)
    ℓ   = log S − (z_t − m)

Backward, on the local shard only:  ∂ℓ/∂z_j = softmax_j − [j == t]  =  exp(z_j − m)/S − 1[j == t].

Vocabulary padding: columns whose global index is ≥ ``vocab_size`` (the embedding table
padded to a multiple of tp, say) are treated as −∞: they take no probability and get a
zero gradient. Memory: one fp32 copy of the local logits is made and becomes the softmax
kept for backward; backward writes the gradient into a new tensor, so the graph can be
run backward twice (a zero-bubble pipeline's separate input- and weight-gradient passes).

Targets outside [0, vocab_size) (an ignore index such as −100) give ℓ = log S and are
not masked here: weight the per-token loss with a loss mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import comm
from parallel.tensor.mappings import tp_rank, tp_size

Group = dist.ProcessGroup | None

__all__ = ["vocab_parallel_cross_entropy"]


def _all_reduce(t_sb: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> None:
    """In-place all-reduce over the TP group; skipped at tp == 1."""
    if tp_size(group) > 1:
        comm.all_reduce(t_sb, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """ℓ_sb from local logits z_sbv; backward softmax − one_hot on the local shard."""

    @staticmethod
    def forward(ctx, logits_sbv, targets_sb, group, vocab_size):
        v_local = logits_sbv.size(-1)
        start = tp_rank(group) * v_local
        n_valid = v_local if vocab_size is None else min(max(vocab_size - start, 0), v_local)

        z = logits_sbv.to(torch.float32, copy=True)  # never write into the caller's logits
        z[..., n_valid:] = float("-inf")  # vocabulary padding
        logits_max_sb = z.amax(dim=-1)
        _all_reduce(logits_max_sb, group, op=dist.ReduceOp.MAX)
        z -= logits_max_sb.unsqueeze(-1)

        # z_t − m on the rank that owns t, 0 elsewhere.
        outside_sb = (targets_sb < start) | (targets_sb >= start + n_valid)
        local_t = (targets_sb - start).masked_fill(outside_sb, 0).long()
        target_logit_sb = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        target_logit_sb = target_logit_sb.masked_fill(outside_sb, 0.0)
        _all_reduce(target_logit_sb, group)

        softmax_sbv = z.exp_()  # padding: exp(−∞) = 0
        sum_exp_sb = softmax_sbv.sum(dim=-1)
        _all_reduce(sum_exp_sb, group)
        softmax_sbv /= sum_exp_sb.unsqueeze(-1)

        ctx.save_for_backward(softmax_sbv, local_t, outside_sb)
        ctx.logits_dtype = logits_sbv.dtype
        return torch.log(sum_exp_sb) - target_logit_sb

    @staticmethod
    def backward(ctx, dloss_sb):
        """∂loss/∂z = (softmax − one_hot) · dloss, into a new tensor so that the graph can
        be run backward twice (zero-bubble pipelines split input and weight gradients)."""
        softmax_sbv, local_t, outside_sb = ctx.saved_tensors
        scale_sb1 = dloss_sb.unsqueeze(-1)
        grad_sbv = softmax_sbv * scale_sb1
        owned_sb1 = (~outside_sb).to(grad_sbv.dtype).unsqueeze(-1)  # 1 where this shard owns the target
        grad_sbv.scatter_add_(-1, local_t.unsqueeze(-1), -owned_sb1 * scale_sb1)
        return grad_sbv.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_sbv: torch.Tensor,
    targets_sb: torch.Tensor,
    group: Group,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token loss ℓ_sb (fp32) of this rank's vocab shard ``logits_sbv`` [s, b, v/tp].

    ``targets_sb`` [s, b] holds global token ids, the same on every TP rank. Columns with
    global index ≥ ``vocab_size`` are excluded (None: all columns are real). Issues
    exactly three all-reduces of [s, b] fp32 tensors (none at tp == 1); backward none.
    """
    tp = tp_size(group)
    if vocab_size is not None and not 0 < vocab_size <= tp * logits_sbv.size(-1):
        raise ValueError(f"vocab_size={vocab_size} must be in [1, tp·v_local={tp * logits_sbv.size(-1)}]")
    return _VocabParallelCrossEntropy.apply(logits_sbv, targets_sb, group, vocab_size)
