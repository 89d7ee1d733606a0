"""Auxiliary losses of a pipeline chunk that does not compute the training loss.

A model whose last chunk computes the loss adds its own MoE auxiliary losses to it, so they
are scaled as the loss is (1/m for m micro-batches, an fp16 loss scale). A chunk before it
has no loss to add them to: `attach` ties them to the chunk's output, whose backward then
starts from the gradient of the next stage and adds the auxiliary losses' own gradient,
multiplied by the scale of the loss of that micro-batch. The pipeline executor sets that
scale (`backward_scale`) around each forward of such a chunk, so that every stage's
auxiliary losses join the backward exactly as they would in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_scale: torch.Tensor | None = None


@contextlib.contextmanager
def backward_scale(scale: torch.Tensor) -> Iterator[None]:
    """Inside: auxiliary losses attached to a chunk's output are back-propagated × `scale`
    (the factor the training loss of the same micro-batch is back-propagated with)."""
    global _scale
    outer, _scale = _scale, scale
    try:
        yield
    finally:
        _scale = outer


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:  # type: ignore[override]
        (scale,) = ctx.saved_tensors
        return g, scale.to(g.device), None


def attach(x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """`x`, whose backward also back-propagates `aux` (a scalar) × the scale set by
    `backward_scale`; one sentence if none is set, since the auxiliary losses would then be
    lost or mis-scaled."""
    if not aux.requires_grad or not torch.is_grad_enabled():
        return x
    if _scale is None:
        raise RuntimeError(
            "a model chunk without the loss computed MoE auxiliary losses outside a pipeline executor, so nothing "
            "scales their gradient like the loss's: run it through parallel.pipeline.PipelineExecutor, or wrap its "
            "forward in parallel.expert.aux_loss.backward_scale(s) with s the factor your loss is back-propagated with"
        )
    return _Attach.apply(x, aux, _scale.detach().reshape(()).float())
