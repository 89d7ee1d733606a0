"""parallel/dims.py: layout validation, coordinates, group memberships, labels.

Expected memberships are derived here by brute force from the row-major (pp, dp, tp)
grid, independently of ParallelDims' own arithmetic, and checked by all-reducing a
one-hot vector over each group: the result marks exactly the group's ranks.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist

from parallel import ParallelDims, accounting, comm
from tests.dist_utils import run_distributed

# (tp, pp, dp) on 8 ranks: 3D, pure DP, pure TP, TP × PP, PP × DP.
LAYOUTS_8 = [(2, 2, 2), (1, 1, 8), (8, 1, 1), (2, 4, 1), (1, 2, 4)]


# ---------------------------------------------------------------------------
# Validation: no process group involved
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp": 3, "pp": 2, "world_size": 8}, "tp=3 × pp=2 = 6 does not divide the world size 8"),
        ({"tp": 0, "world_size": 8}, "tp=0 must be a positive integer"),
        ({"pp": -1, "world_size": 8}, "pp=-1 must be a positive integer"),
        ({"dp": 0, "world_size": 8}, "dp=0 must be a positive integer"),
        ({"tp": 2.0, "world_size": 8}, "tp=2.0 must be a positive integer"),
        ({"tp": True, "world_size": 8}, "tp=True must be a positive integer"),
        ({"world_size": 0}, "world_size=0 must be a positive integer"),
        (
            {"tp": 2, "pp": 2, "dp": 4, "world_size": 8},
            "tp=2 × pp=2 × dp=4 = 16 does not equal the world size 8",
        ),
        ({"tp": 16, "world_size": 8}, "tp=16 × pp=1 = 16 does not divide the world size 8"),
        (
            {"tp": 2, "dp_shard": 3, "world_size": 8},
            "dp_shard=3 does not divide dp=4: hybrid sharding needs dp = replicas × dp_shard",
        ),
        ({"dp_shard": 0, "world_size": 8}, "dp_shard=0 must be a positive integer"),
        ({"ranks_per_node": 0, "world_size": 8}, "ranks_per_node=0 must be a positive integer"),
    ],
)
def test_invalid_layouts_are_refused_in_one_sentence(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        ParallelDims(**kwargs)
    assert str(info.value) == message
    assert not dist.is_initialized()


def test_dp_inferred_or_checked_and_str() -> None:
    dims = ParallelDims(tp=2, pp=2, world_size=8)
    assert dims.dp == 2
    assert str(dims) == "tp=2 pp=2 dp=2 (world 8)"
    assert ParallelDims(tp=2, pp=2, dp=2, world_size=8) == dims
    assert ParallelDims(world_size=8).dp == 8
    assert ParallelDims(tp=8, world_size=8).dp == 1


def test_world_size_defaults_to_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert ParallelDims(tp=4).world_size == 8 and ParallelDims(tp=4).dp == 2
    monkeypatch.delenv("WORLD_SIZE")
    assert ParallelDims().world_size == 1
    assert "WORLD_SIZE" not in os.environ


@pytest.mark.parametrize("tp, pp, dp", LAYOUTS_8)
def test_rank_arithmetic_matches_row_major_grid(tp: int, pp: int, dp: int) -> None:
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, world_size=8)
    grid = torch.arange(8).view(pp, dp, tp)  # DeviceMesh's layout
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        assert dims.rank_of(p, d, t) == grid[p, d, t].item()
        assert dims.coords_of(grid[p, d, t].item()) == (p, d, t)


def test_groups_need_build() -> None:
    dims = ParallelDims(tp=2, world_size=2)
    with pytest.raises(RuntimeError, match=r"call build\(\) first"):
        _ = dims.tp_group
    with pytest.raises(RuntimeError, match=r"call build\(\) first"):
        _ = dims.pp_rank


# ---------------------------------------------------------------------------
# Built on gloo ranks
# ---------------------------------------------------------------------------


def _expected(tp: int, pp: int, dp: int, world: int) -> dict:
    """Per rank: coordinates and member lists, by enumerating the grid."""
    coords = list(itertools.product(range(pp), range(dp), range(tp)))  # index = rank
    rank = dist.get_rank()
    p, d, t = coords[rank]

    def same(*axes: int) -> list[int]:
        return [r for r, c in enumerate(coords) if all(c[a] == coords[rank][a] for a in axes)]

    members = {"tp": same(0, 1), "dp": same(0, 2), "pp": same(1, 2), "mp": same(1)}
    if pp > 1 and p in (0, pp - 1):
        members["embedding"] = [r for r in same(1, 2) if coords[r][0] in (0, pp - 1)]
    stage = {c[0]: r for r, c in enumerate(coords) if c[1:] == (d, t)}
    return {
        "coords": (p, d, t),
        "members": members,
        "prev": stage.get(p - 1),
        "next": stage.get(p + 1),
    }


def _check_layout(tp: int, pp: int, dp: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(tp=tp, pp=pp, dp=dp).build("cpu")
    assert dims.world_size == world and str(dims) == f"tp={tp} pp={pp} dp={dp} (world {world})"
    exp = _expected(tp, pp, dp, world)

    assert dims.mesh.mesh_dim_names == ("pp", "dp", "tp")
    assert dims.mesh.mesh.tolist() == torch.arange(world).view(pp, dp, tp).tolist()
    assert (dims.pp_rank, dims.dp_rank, dims.tp_rank) == exp["coords"]
    assert tuple(dims.mesh.get_coordinate()) == exp["coords"]
    assert dims.is_first_stage == (exp["coords"][0] == 0)
    assert dims.is_last_stage == (exp["coords"][0] == pp - 1)
    assert (dims.prev_stage_rank, dims.next_stage_rank) == (exp["prev"], exp["next"])

    groups = {
        "tp": dims.tp_group,
        "pp": dims.pp_group,
        "dp": dims.dp_group,
        "mp": dims.mp_group,
        "embedding": dims.embedding_group,
    }
    assert groups["tp"] is dims.mesh.get_group("tp")
    if "embedding" not in exp["members"]:
        assert groups.pop("embedding") is None
    # Each dimension its own object: never WORLD, even when it spans every rank.
    assert len({id(g) for g in groups.values()}) == len(groups)
    assert all(g is not dist.group.WORLD for g in groups.values())

    with accounting.tracking() as log:
        for name, group in groups.items():
            assert dist.get_process_group_ranks(group) == exp["members"][name], name
            onehot = torch.zeros(world)
            onehot[rank] = 1.0
            comm.all_reduce(onehot, group=group)
            assert onehot.nonzero().flatten().tolist() == exp["members"][name], name
        comm.barrier()
    stats = log.as_dict()
    assert stats == {
        **{name: {"all_reduce": stats[name]["all_reduce"]} for name in groups},
        "world": {"barrier": {"calls": 1, "bytes": 0, "payload_bytes": 0}},
    }
    for name in groups:
        n = len(exp["members"][name])
        assert stats[name]["all_reduce"] == {
            "calls": 1,
            "payload_bytes": 4 * world,
            "bytes": 2 * 4 * world * (n - 1) // n,
        }, name
    assert dims.build() is dims  # idempotent
    return {"coords": exp["coords"], "labels": sorted(groups)}


def _check_layouts(layouts: list[tuple[int, int, int]]) -> list[dict]:
    out = [_check_layout(*layout) for layout in layouts]
    assert accounting.group_name(None) == "world"  # no dimension relabelled WORLD
    return out


def test_layouts_on_8_ranks() -> None:
    """All five layouts coexist in one 8-rank job (each builds its own groups)."""
    results = run_distributed(_check_layouts, 8, LAYOUTS_8, timeout=300)
    for i, (tp, pp, dp) in enumerate(LAYOUTS_8):
        coords = [r[i]["coords"] for r in results]
        assert coords == list(itertools.product(range(pp), range(dp), range(tp)))
        for (p, _, _), r in zip(coords, results):
            with_embedding = pp > 1 and p in (0, pp - 1)
            assert r[i]["labels"] == sorted(["tp", "pp", "dp", "mp"] + ["embedding"] * with_embedding)


def _world_one() -> dict:
    with pytest.raises(ValueError) as info:
        ParallelDims(tp=2, world_size=2).build("cpu")
    mismatch = str(info.value)
    out = _check_layout(1, 1, 1)
    assert accounting.group_name(None) == "world"
    return {"mismatch": mismatch, **out}


def test_world_size_one_and_mismatch() -> None:
    """At world size 1 DeviceMesh would give every dimension the WORLD group; each
    still gets its own group and label. A layout for another world size is refused."""
    (result,) = run_distributed(_world_one, 1)
    assert result["mismatch"] == ("tp=2 × pp=1 × dp=1 = 2 does not equal the world size 1 of the default process group")
    assert result["labels"] == ["dp", "mp", "pp", "tp"]


def _hybrid_groups(tp: int, pp: int, dp_shard: int) -> dict:
    dims = ParallelDims(tp=tp, pp=pp, dp_shard=dp_shard, ranks_per_node=4).build("cpu")
    shard, replicate = dims.dp_shard_group, dims.dp_replicate_group
    return {
        "str": str(dims),
        "coords": dims.coords_of(dist.get_rank()),
        "shard": dist.get_process_group_ranks(shard),
        "replicate": dist.get_process_group_ranks(replicate),
        "labels": (accounting.group_name(shard), accounting.group_name(replicate)),
        "crosses": (
            dims.crosses_nodes(dist.get_process_group_ranks(shard)),
            dims.crosses_nodes(dist.get_process_group_ranks(replicate)),
        ),
    }


def test_hybrid_groups_split_dp_with_the_shard_group_inner() -> None:
    """tp=2 pp=1 dp=4 = 2 replicas × 2 shards on 8 ranks, 4 ranks per node: dp_rank =
    replica · dp_shard + shard_rank, so a shard group (with its tp ranks) is 4 consecutive
    ranks, one node, and a replicate group joins the same shard of both replicas, across."""
    results = run_distributed(_hybrid_groups, 8, 2, 1, 2)
    for rank, r in enumerate(results):
        _, dp_rank, tp_rank = r["coords"]
        replica, shard = divmod(dp_rank, 2)
        assert r["str"] == "tp=2 pp=1 dp=4 (2×2) (world 8)"
        assert r["shard"] == [(replica * 2 + s) * 2 + tp_rank for s in range(2)]
        assert r["replicate"] == [(q * 2 + shard) * 2 + tp_rank for q in range(2)]
        assert rank in r["shard"] and rank in r["replicate"]
        assert r["labels"] == ("dp_shard", "dp_replicate")
        assert r["crosses"] == (False, True)


def _no_replicas() -> tuple:
    dims = ParallelDims().build("cpu")
    return dims.dp_shard_group is dims.dp_group, dims.dp_replicate_group, dims.dp_replicate


def test_without_dp_shard_the_shard_group_is_the_dp_group() -> None:
    assert run_distributed(_no_replicas, 2) == [(True, None, 1)] * 2
