"""parallel/random.py: dropout masks per TP rank inside fork(), shared outside; the
default stream is untouched by a fork; runs are reproducible."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.random import RNGTracker, get_rng_tracker, seed_everything
from tests.dist_utils import run_distributed

N = 256  # dropout mask length: two independent p=0.5 masks agree with probability 2^-256


def _mask() -> torch.Tensor:
    return F.dropout(torch.ones(N), p=0.5, training=True) != 0


def _masks(seed: int, tp: int) -> dict:
    """This rank as (pp_rank, tp_rank) = divmod(rank, tp): masks drawn outside, inside,
    outside a fork, and a reference of the default stream drawn without any fork."""
    pp_rank, tp_rank = divmod(dist.get_rank(), tp)
    tracker = seed_everything(seed, tp_rank=tp_rank, pp_rank=pp_rank)
    assert get_rng_tracker() is tracker
    before = _mask()
    with tracker.fork():
        inside = [_mask(), _mask()]
    after = _mask()
    with tracker.fork("tensor-parallel"):
        inside_again = _mask()  # the TP stream continues where it stopped
    last = _mask()

    torch.manual_seed(seed + 100 * pp_rank)  # the default stream, never forked
    reference = [_mask() for _ in range(3)]
    return {
        "coords": (pp_rank, tp_rank),
        "outside": torch.stack([before, after, last]),
        "reference": torch.stack(reference),
        "inside": torch.stack([*inside, inside_again]),
    }


def test_masks_per_tp_rank_and_default_stream_untouched() -> None:
    """4 ranks = 2 pipeline stages × 2 TP ranks."""
    tp = 2
    results = run_distributed(_masks, 4, 1234, tp)
    for r in results:
        assert torch.equal(r["outside"], r["reference"])  # fork did not disturb the default
        assert len({tuple(m.tolist()) for m in r["inside"]}) == 3  # a stream, not a replay
    for stage in (0, 1):
        a, b = (r for r in results if r["coords"][0] == stage)
        assert torch.equal(a["outside"], b["outside"])  # replicated: same masks on TP ranks
        assert not (a["inside"] == b["inside"]).all(dim=1).any()  # split: every mask differs
    by_stage = [r for r in results if r["coords"][1] == 0]
    assert not torch.equal(by_stage[0]["outside"], by_stage[1]["outside"])  # seed + 100·pp

    again = run_distributed(_masks, 4, 1234, tp)
    for r1, r2 in zip(results, again):
        for key in ("outside", "inside"):
            assert torch.equal(r1[key], r2[key])
    other_seed = run_distributed(_masks, 4, 99, tp)
    assert not torch.equal(results[0]["inside"], other_seed[0]["inside"])


def test_unknown_name_and_duplicate_add() -> None:
    tracker = RNGTracker()
    tracker.add("tensor-parallel", 1)
    with pytest.raises(KeyError, match="no RNG state named 'expert'"), tracker.fork("expert"):
        pass
    with pytest.raises(ValueError, match="RNG state 'tensor-parallel' was already added"):
        tracker.add("tensor-parallel", 2)
    with pytest.raises(KeyError, match="no RNG state named 'tensor-parallel'"), RNGTracker().fork():
        pass


def test_add_leaves_default_stream_and_matches_manual_seed() -> None:
    torch.manual_seed(5)
    expected = torch.rand(8)
    torch.manual_seed(5)
    tracker = RNGTracker()
    tracker.add("a", 7)
    assert torch.equal(torch.rand(8), expected)
    with tracker.fork("a"):
        forked = torch.rand(8)
    torch.manual_seed(7)
    assert torch.equal(forked, torch.rand(8))


def test_nested_forks_and_exceptions_restore_state() -> None:
    tracker = RNGTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"), tracker.fork("a"):
        torch.rand(3)
        with tracker.fork("b"):
            torch.rand(3)
            with pytest.raises(RuntimeError, match="already forked"), tracker.fork("a"):
                pass
        raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), state)
    # Each stream advanced by its own draws only.
    with tracker.fork("a"):
        a = torch.rand(3)
    with tracker.fork("b"):
        b = torch.rand(3)
    torch.manual_seed(1)
    torch.rand(3)
    assert torch.equal(a, torch.rand(3))
    torch.manual_seed(2)
    torch.rand(3)
    assert torch.equal(b, torch.rand(3))


def test_state_dict_round_trip() -> None:
    tracker = seed_everything(3, tp_rank=1)
    with tracker.fork():
        torch.rand(4)
    saved = tracker.state_dict()
    with tracker.fork():
        expected = torch.rand(4)
    restored = RNGTracker()
    restored.load_state_dict(saved)
    with restored.fork():
        assert torch.equal(torch.rand(4), expected)
    assert saved["tensor-parallel"]["seed"] == 3 + 2718 + 1
