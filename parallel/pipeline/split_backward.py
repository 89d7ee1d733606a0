"""Backward split into an input-gradient step (B) and a weight-gradient step (W), as the
zero-bubble schedules need (Qi et al. 2023).

B computes ∂L/∂x only, and on the way records the gradient arriving at each "boundary"
node: a node on the path from the output to the input x that also feeds a weight through
nodes off that path (for y = x Wᵀ + b: the addmm node, whose other inputs lead to Wᵀ and
b). W then starts one backward per boundary node from its recorded gradient, restricted
to the weights it feeds, so it computes only ∂L/∂W (the addmm node computes its weight
outputs only) instead of running the whole backward again. Weights no boundary node
reaches (all of them on the first stage, whose input is token ids) get a backward from the
output restricted to them. A weight fed by one boundary node can be reached from it only
through that node's off-path inputs, so each part delivers its weights' whole gradient;
if some weight is fed by two boundary nodes (a weight used twice), W falls back to one
backward from the output for all weights, so nothing is ever counted twice. Gradients accumulate through autograd's AccumulateGrad, so
parameter hooks (an optimizer's, sequence-parallel sync) see them as in a plain backward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _graph(root: Node) -> list[Node]:
    """Every node reachable from `root` through next_functions."""
    seen: dict[Node, None] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen[node] = None
        stack.extend(child for child, _ in node.next_functions)
    return list(seen)


def _reaches(root: Node, target: Node) -> dict[Node, bool]:
    """node -> whether `target` is reachable from it (post-order: children settle first)."""
    memo: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if node in memo:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if children_done:
            memo[node] = node is target or any(memo[c] for c in children)
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in memo)
    return memo


class WeightGradients:
    """The W step of one (micro-batch, chunk): `run` accumulates ∂L/∂W into the weights."""

    def __init__(
        self,
        out: torch.Tensor | GradientEdge,
        grad: torch.Tensor | None,
        parts: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]],
        rest: list[torch.Tensor],
    ) -> None:
        self.out, self.grad, self.parts, self.rest = out, grad, parts, rest

    def run(self, deferred: Callable[[bool], AbstractContextManager]) -> None:
        """One backward per part, then one from the output for the rest; `deferred(last)`
        wraps each (an optimizer's no_sync for all but the last backward of the step).
        Once the next part's weights have no storage (ZeRO stage 3 frees gathered parameters
        after a backward, and only a backward through their modules gathers them again),
        the remaining parts join the rest: their weights are disjoint from the parts done."""
        pending, rest = list(self.parts), list(self.rest)
        while pending or rest:
            if pending and any(w.numel() == 0 for w in pending[0][2]):
                rest += [w for _, _, ws in pending for w in ws]
                pending = []
            if pending:
                edges, grads, weights = pending.pop(0)
            else:
                edges, grads, weights = [self.out], None if self.grad is None else [self.grad], rest
                rest = []
            last = not pending and not rest
            with deferred(last):
                torch.autograd.backward(edges, grad_tensors=grads, inputs=weights, retain_graph=not last)


def backward_input(
    out: torch.Tensor | GradientEdge, grad: torch.Tensor | None, x: torch.Tensor | None, weights: list[torch.Tensor]
) -> tuple[torch.Tensor | None, WeightGradients]:
    """B: (∂L/∂x or None, the W step still to run). `out` is the chunk's output (or its
    gradient edge) or the loss, `grad` the gradient arriving at it (None for a loss)."""
    root = out.node if isinstance(out, GradientEdge) else out.grad_fn
    accumulators = {get_gradient_edge(w).node: w for w in weights}
    if x is None:
        return None, WeightGradients(out, grad, [], weights)
    reaches_x = _reaches(root, get_gradient_edge(x).node)  # keys: every node of the graph
    boundary: dict[Node, list[torch.Tensor]] = {}
    owners: dict[torch.Tensor, int] = {}
    for node in reaches_x:
        if not reaches_x.get(node):
            continue
        fed = [
            w
            for c, _ in node.next_functions
            if c is not None and not reaches_x.get(c, False)
            for w in _weights_below(c, accumulators)
        ]
        if fed:
            boundary[node] = fed
            for w in fed:
                owners[w] = owners.get(w, 0) + 1
    rest = [w for w in weights if w not in owners]
    if any(n > 1 for n in owners.values()):
        (dx,) = torch.autograd.grad(out, x, grad, retain_graph=True)
        return dx, WeightGradients(out, grad, [], weights)
    captured: dict[Node, tuple] = {}
    hooks = [node.register_prehook(lambda grads, node=node: captured.__setitem__(node, grads)) for node in boundary]
    try:
        (dx,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    parts = []
    for node, fed in boundary.items():
        grads = captured.get(node, ())
        edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
        if edges:
            parts.append((edges, [g for g in grads if g is not None], fed))
        else:
            rest.extend(fed)
    return dx, WeightGradients(out, grad, parts, rest)


def _weights_below(node: Node, accumulators: dict[Node, torch.Tensor]) -> list[torch.Tensor]:
    """Weights whose accumulator is reachable from `node`."""
    return [accumulators[n] for n in _graph(node) if n in accumulators]
