"""How a model's layers split into pipeline stages.

With S = pp·v virtual stages and L layers, stage k holds layers [k·L/S, (k+1)·L/S) when S
divides L. Otherwise the split is refused unless `allow_uneven`: then the L mod S extra
layers go one each to the middle stages first (the first stage also runs the embedding
and the last the head and loss, so they are the heavier ones), never dropped.
"""

from __future__ import annotations


def layer_ranges(n_layers: int, n_stages: int, allow_uneven: bool = False) -> list[range]:
    """The layers of each virtual stage, in stage order, covering range(n_layers) exactly."""
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} pipeline stages (each needs at least one layer)")
    base, extra = divmod(n_layers, n_stages)
    if extra and not allow_uneven:
        raise ValueError(
            f"{n_layers} layers do not split evenly into {n_stages} pipeline stages (pp × virtual stages); "
            "change the layer count or allow an uneven split"
        )
    middle_first = sorted(range(n_stages), key=lambda k: (k in (0, n_stages - 1), abs(2 * k - (n_stages - 1))))
    sizes = [base] * n_stages
    for k in middle_first[:extra]:
        sizes[k] += 1
    starts = [sum(sizes[:k]) for k in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]
