"""RNG streams: dropout that agrees across TP ranks where activations are replicated,
and differs where they are split.

Two kinds of random draws happen in a tensor-parallel model (Shoeybi et al. 2019, §3):

- on *replicated* activations (after the row-parallel all-reduce ``g``, residual
  stream, embeddings): every TP rank holds the same tensor and must draw the same
  dropout mask, or the replicas drift apart. These use torch's default generator,
  seeded ``seed + 100·pp_rank``: equal on all TP (and DP) ranks of a stage.
- on *split* activations (attention probabilities of this rank's heads, the
  column-parallel MLP's hidden units): each rank holds a different slice and must
  draw an independent mask, else the slices' masks would be copies of one another.
  These run inside ``get_rng_tracker().fork()``, whose "tensor-parallel" stream is
  seeded ``seed + 2718 + tp_rank``.

``fork(name)`` swaps the tracker's saved state into the default generator(s) (CPU,
and the current CUDA device's when CUDA is available), runs the block, saves the
advanced state back under ``name`` and restores the default state it displaced, so
the default stream continues exactly as if the block had not run. This is
Megatron-LM's ``CudaRNGStatesTracker`` (megatron/core/tensor_parallel/random.py),
for CPU as well as CUDA.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["TENSOR_PARALLEL", "RNGTracker", "get_rng_tracker", "seed_everything"]

TENSOR_PARALLEL = "tensor-parallel"
_TP_OFFSET = 2718  # any positive offset keeps the TP seeds apart from the default ones
_PP_STRIDE = 100  # default seed = seed + 100·pp_rank

_State = tuple[torch.Tensor, torch.Tensor | None]  # (CPU state, current CUDA device's state)


def _get_state() -> _State:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_state(state: _State) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _seeded_state(seed: int) -> _State:
    """The state ``torch.manual_seed(seed)`` would give, without touching the defaults."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    cuda = None
    if torch.cuda.is_available():
        cuda = torch.Generator(device=torch.device("cuda", torch.cuda.current_device())).manual_seed(seed).get_state()
    return cpu, cuda


class RNGTracker:
    """Named generator states that ``fork(name)`` swaps in and out of the defaults.

    Each name is an independent stream: a second ``fork(name)`` continues where the
    previous one stopped. Forks of different names nest; re-entering a name that is
    already forked raises (its draws would be replayed).
    """

    def __init__(self) -> None:
        self._states: dict[str, _State] = {}
        self._seeds: dict[str, int] = {}
        self._active: set[str] = set()

    def add(self, name: str, seed: int) -> None:
        """Start stream ``name`` from ``seed``. The default generators are not touched."""
        if name in self._states:
            raise ValueError(
                f"RNG state {name!r} was already added (seed {self._seeds[name]}); use a new name or a new RNGTracker"
            )
        self._states[name] = _seeded_state(seed)
        self._seeds[name] = seed

    def names(self) -> list[str]:
        """Names added so far, in order."""
        return list(self._states)

    @contextmanager
    def fork(self, name: str = TENSOR_PARALLEL) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream is left as it was."""
        if name not in self._states:
            raise KeyError(
                f"no RNG state named {name!r} (known: {self.names()}); "
                "call seed_everything(...) or RNGTracker.add(name, seed) first"
            )
        if name in self._active:
            raise RuntimeError(f"RNG state {name!r} is already forked; forks of one name cannot nest")
        outer = _get_state()
        _set_state(self._states[name])
        self._active.add(name)
        try:
            yield
        finally:
            self._active.discard(name)
            self._states[name] = _get_state()
            _set_state(outer)

    def state_dict(self) -> dict[str, dict]:
        """Every stream's current state (for checkpoints); tensors are copies."""
        return {
            name: {"seed": self._seeds[name], "cpu": cpu.clone(), "cuda": None if cuda is None else cuda.clone()}
            for name, (cpu, cuda) in self._states.items()
        }

    def load_state_dict(self, state: dict[str, dict]) -> None:
        """Replace all streams by those of ``state_dict()``. A CUDA state missing from
        the checkpoint (saved without CUDA) is re-derived from the stream's seed."""
        states, seeds = {}, {}
        for name, entry in state.items():
            cpu, cuda = entry["cpu"].clone(), entry["cuda"]
            if torch.cuda.is_available():
                cuda = _seeded_state(entry["seed"])[1] if cuda is None else cuda.clone()
            else:
                cuda = None
            states[name], seeds[name] = (cpu, cuda), entry["seed"]
        self._states, self._seeds = states, seeds

    def __repr__(self) -> str:
        return f"RNGTracker({self._seeds})"


_tracker = RNGTracker()


def get_rng_tracker() -> RNGTracker:
    """The tracker set by the last ``seed_everything`` (an empty one before that)."""
    return _tracker


def seed_everything(seed: int, tp_rank: int = 0, pp_rank: int = 0) -> RNGTracker:
    """Seed this rank's generators for a run; returns the new current tracker.

    default generators (torch CPU + all CUDA devices, ``random``, numpy if installed):
        ``seed + 100·pp_rank`` — same on every TP and DP rank of a pipeline stage.
    tracker stream "tensor-parallel":
        ``seed + 2718 + tp_rank`` — different on every TP rank.
    """
    default_seed = seed + _PP_STRIDE * pp_rank
    torch.manual_seed(default_seed)
    random.seed(default_seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(default_seed % 2**32)
    global _tracker
    _tracker = RNGTracker()
    _tracker.add(TENSOR_PARALLEL, seed + _TP_OFFSET + tp_rank)
    return _tracker
