"""Tests for optim/sharded_state.py: flat-range boxes and DCP resharding across ZeRO layouts."""

from __future__ import annotations

import itertools
import math
import random
import tempfile
import zlib
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from optim.sharded_state import flat_range_boxes, sharded_tensor_from_flat
from tests.dist_utils import run_distributed

# ---------------------------------------------------------------- flat_range_boxes


def _flat_indices(shape: Sequence[int], offsets: list[int], sizes: list[int]) -> list[int]:
    """Row-major flat indices of the box, in flat order."""
    idx = torch.arange(math.prod(shape)).reshape(list(shape))
    return idx[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1).tolist()


def _random_shape(rng: random.Random) -> list[int]:
    dims = [1, 2, 3, 4, 5, 7, 11, 13]
    return [rng.choice(dims) for _ in range(rng.randint(1, 4))]


def test_flat_range_boxes_cover_range_exactly() -> None:
    rng = random.Random(0)
    for _ in range(1500):
        shape = _random_shape(rng)
        n = math.prod(shape)
        start = rng.randint(0, n)
        end = rng.randint(start, n)
        boxes = flat_range_boxes(shape, start, end)
        assert len(boxes) <= 2 * len(shape) - 1
        covered: list[int] = []
        for offsets, sizes in boxes:
            assert len(offsets) == len(sizes) == len(shape)
            assert all(s >= 1 and o >= 0 and o + s <= d for o, s, d in zip(offsets, sizes, shape))
            cells = _flat_indices(shape, offsets, sizes)
            assert cells == list(range(cells[0], cells[0] + len(cells))), "box not contiguous"
            covered += cells
        # In flat order, disjoint, exactly [start, end).
        assert covered == list(range(start, end)), (shape, start, end, boxes)


def test_flat_range_boxes_worst_case_and_edges() -> None:
    # Range that starts and ends mid-row at every level: 2*ndim-1 boxes.
    assert flat_range_boxes([3, 3, 3], 4, 23) == [
        ([0, 1, 1], [1, 1, 2]),
        ([0, 2, 0], [1, 1, 3]),
        ([1, 0, 0], [1, 3, 3]),
        ([2, 0, 0], [1, 1, 3]),
        ([2, 1, 0], [1, 1, 2]),
    ]
    assert len(flat_range_boxes([4, 4, 4, 4], 16 + 4 + 1, 256 - 16 - 4 - 1)) == 7
    assert flat_range_boxes([2, 3], 0, 6) == [([0, 0], [2, 3])]
    assert flat_range_boxes([2, 3], 4, 4) == []
    assert flat_range_boxes([], 0, 1) == [([0], [1])]
    with pytest.raises(ValueError):
        flat_range_boxes([2, 3], 2, 7)


def _is_box(shape: list[int], start: int, end: int) -> bool:
    """Whether non-empty flat ``[start, end)`` of a row-major ``shape`` is one box (corner-to-corner volume)."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    lo = [start // st % d for st, d in zip(strides, shape)]
    hi = [(end - 1) // st % d for st, d in zip(strides, shape)]
    return all(b >= a for a, b in zip(lo, hi)) and math.prod(b - a + 1 for a, b in zip(lo, hi)) == end - start


def test_flat_range_boxes_is_fewest_in_flat_order() -> None:
    # Exhaustive: for every range, the fewest consecutive flat segments that are boxes (DP from each start).
    for shape in [[2, 3, 4], [3, 1, 3], [2, 2, 2, 2], [3, 2, 1, 2], [4, 5]]:
        n = math.prod(shape)
        for start in range(n + 1):
            fewest = {start: 0}
            for end in range(start + 1, n + 1):
                fewest[end] = 1 + min(fewest[i] for i in range(start, end) if _is_box(shape, i, end))
            for end in range(start, n + 1):
                assert len(flat_range_boxes(shape, start, end)) == fewest[end], (shape, start, end)


# ---------------------------------------------------------------- simulated ZeRO layout

SHAPES: dict[str, list[int]] = {
    "a": [7],
    "b": [5, 3],
    "c": [2, 3, 5],
    "d": [13, 11],
    "prime": [31],
    "tiny": [2],  # lands on one or two ranks only: empty elsewhere
    "e": [2, 3, 1, 5],
    "scalar": [],
    "empty": [3, 0],
}
KEYS = ("exp_avg", "exp_avg_sq")
Pieces = dict[str, list[list[tuple[int, int, int]]]]


def _params(*prefixes: str) -> dict[str, list[int]]:
    return {f"{pre}{name}": shape for pre in prefixes for name, shape in SHAPES.items()}


def _truth(fqn: str, key: str, shape: list[int]) -> torch.Tensor:
    """Deterministic value of optimizer state ``key`` of parameter ``fqn``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(f"{fqn}/{key}".encode())))


def _layout(params: dict[str, list[int]], n: int, bucket_cap: int) -> tuple[int, Pieces]:
    """Simulate ZeRO buckets over ``params`` packed in dict order, a param split at bucket boundaries.

    Buckets hold ``bucket_cap`` elements of the concatenated flat params (the last one less),
    each padded to a multiple of ``n``; rank r owns ``[r*S/n, (r+1)*S/n)`` of each bucket,
    stored back to back in its flat shard. Returns the shard length and, per param and rank,
    pieces ``(param_flat_start, param_flat_end, shard_offset)``.
    """
    total = sum(math.prod(shape) for shape in params.values())
    pieces: Pieces = {p: [[] for _ in range(n)] for p in params}
    shard_len = 0
    for b0 in range(0, total, bucket_cap):
        b1 = min(b0 + bucket_cap, total)
        per_rank = -(-(b1 - b0) // n)
        end = 0
        for p, shape in params.items():
            p0, end = end, end + math.prod(shape)
            for r in range(n):
                lo, hi = max(p0, b0 + r * per_rank), min(end, b0 + (r + 1) * per_rank, b1)
                if lo < hi:
                    pieces[p][r].append((lo - p0, hi - p0, shard_len + lo - b0 - r * per_rank))
        shard_len += per_rank
    return shard_len, pieces


def _expected_flat(params: dict[str, list[int]], key: str, length: int, pieces: Pieces, rank: int) -> torch.Tensor:
    """This rank's flat shard of state ``key`` under the layout; padding is 0."""
    flat = torch.zeros(length)
    for p, shape in params.items():
        truth = _truth(p, key, shape).reshape(-1)
        for s, e, o in pieces[p][rank]:
            flat[o : o + e - s] = truth[s:e]
    return flat


def _rank_state(
    params: dict[str, list[int]],
    bucket_cap: int,
    group: dist.ProcessGroup | None,
    filled: bool,
    replicated: bool = False,
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(state dict, flat shards it views, expected flat shards) of this rank in ``group``.

    The state dict is Adam-like: ``{key: {fqn: state}}`` plus a plain tensor ``step`` and a
    python float ``lr`` (3.0 and 0.1 when ``filled``, else zeros). Sharded (ZeRO >= 1): each
    state is a ``ShardedTensor`` over this rank's pieces. ``replicated`` (ZeRO-0): every rank
    holds the whole unpadded flat buffer and each state is a plain full-shape view of it.
    """
    n, rank = (1, 0) if replicated else (dist.get_world_size(group), dist.get_rank(group))
    length, pieces = _layout(params, n, bucket_cap)
    expected = {k: _expected_flat(params, k, length, pieces, rank) for k in KEYS}
    flats = {k: v.clone() if filled else torch.zeros(length) for k, v in expected.items()}
    state: dict[str, Any] = {"step": torch.tensor(3.0 if filled else 0.0), "lr": 0.1 if filled else 0.0}
    starts = dict(zip(params, itertools.accumulate((math.prod(s) for s in params.values()), initial=0)))
    for k, flat in flats.items():
        if replicated:
            state[k] = {p: flat[starts[p] : starts[p] + math.prod(sh)].view(sh) for p, sh in params.items()}
            continue
        state[k] = {
            p: sharded_tensor_from_flat(
                shape,
                [(s, flat[o : o + e - s]) for s, e, o in pieces[p][rank]],
                [[(s, e) for s, e, _ in per_rank] for per_rank in pieces[p]],
                group,
            )
            for p, shape in params.items()
        }
    return state, flats, expected


def _save(path: str, params: dict[str, list[int]], bucket_cap: int, replicated: bool = False) -> int:
    """Save under this world's layout; returns how many tensors or shards this rank offered."""
    state, _, _ = _rank_state(params, bucket_cap, None, True, replicated)
    dcp.save(state, checkpoint_id=path)
    return sum(1 if replicated else len(st.local_shards()) for st in state["exp_avg"].values())


def _save_tp_dp(path: str, bucket_cap: int) -> None:
    """World 4 as tp=2 x dp=2 (tp inner): DP group {t, t+2} shards ``tp{t}.*`` and TP-replicated ``shared.*``."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp = dist.get_rank() % 2
    state, _, _ = _rank_state(_params(f"tp{tp}.", "shared."), bucket_cap, groups[tp], filled=True)
    dcp.save(state, checkpoint_id=path)


def _load(path: str, params: dict[str, list[int]], bucket_cap: int, replicated: bool = False) -> bool:
    """Load into zeroed flat shards of this world's layout; check every element and the scalars."""
    state, flats, expected = _rank_state(params, bucket_cap, None, False, replicated)
    dcp.load(state, checkpoint_id=path)
    for k in KEYS:
        torch.testing.assert_close(flats[k], expected[k], rtol=0, atol=0)
    assert state["step"].item() == 3.0 and state["lr"] == 0.1
    return True


def test_layout_has_empty_and_multi_piece_ranks() -> None:
    _, pieces = _layout(_params(""), 4, 40)
    assert any(not per_rank for per_rank in pieces["tiny"]), "some rank must hold nothing of 'tiny'"
    assert any(len(per_rank) > 1 for p in pieces.values() for per_rank in p), "some rank must hold several pieces"


def test_dcp_reshard_across_layouts() -> None:
    params = _params("")
    reordered = dict(reversed(params.items()))
    with tempfile.TemporaryDirectory() as path:
        assert sum(run_distributed(_save, 4, path, params, 40)) > len(params)
        assert run_distributed(_load, 2, path, params, 1000) == [True] * 2
        assert run_distributed(_load, 1, path, reordered, 64) == [True]
        assert run_distributed(_load, 3, path, reordered, 50) == [True] * 3
        assert run_distributed(_load, 2, path, reordered, 64, replicated=True) == [True] * 2


def test_dcp_replicated_stage0_loads_sharded() -> None:
    with tempfile.TemporaryDirectory() as path:
        assert run_distributed(_save, 2, path, _params(""), 64, replicated=True) == [len(SHAPES)] * 2
        assert run_distributed(_load, 3, path, _params(""), 20) == [True] * 3


def test_dcp_subgroup_placements_load_without_subgroups() -> None:
    with tempfile.TemporaryDirectory() as path:
        run_distributed(_save_tp_dp, 4, path, 30)
        assert run_distributed(_load, 2, path, _params("shared.", "tp1.", "tp0."), 45) == [True] * 2


def test_pieces_must_match_ranges() -> None:
    run_distributed(_check_mismatch_raises, 1)


def _check_mismatch_raises() -> None:
    flat = torch.zeros(6)
    with pytest.raises(ValueError, match="do not match"):
        sharded_tensor_from_flat([2, 3], [(0, flat[:5])], [[(0, 6)]])
    with pytest.raises(ValueError, match="overlap"):
        sharded_tensor_from_flat([2, 3], [(0, flat), (2, flat[:2])], [[(0, 6), (2, 4)]])
