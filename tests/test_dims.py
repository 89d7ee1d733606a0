"""parallel/dims.py: layout validation, coordinates, group memberships, labels.

Expected memberships are derived here by brute force from the row-major (pp, dp, cp, tp)
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

# (tp, pp, dp, cp) on 8 ranks: 3D, pure DP, pure TP, TP × PP, PP × DP, and with context
# parallelism: TP × CP × DP, PP × DP × CP, DP × CP.
LAYOUTS_8 = [
    (2, 2, 2, 1),
    (1, 1, 8, 1),
    (8, 1, 1, 1),
    (2, 4, 1, 1),
    (1, 2, 4, 1),
    (2, 1, 2, 2),
    (1, 2, 2, 2),
    (1, 1, 2, 4),
]


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
        ({"tp": 2, "cp": 3, "world_size": 8}, "tp=2 × cp=3 × pp=1 = 6 does not divide the world size 8"),
        (
            {"cp": 4, "cp_a2a": 3, "world_size": 8},
            "cp_a2a=3 does not divide cp=4: the cp ranks form rings of all-to-all groups of that size",
        ),
        (
            {"cp": 2, "ep": 3, "world_size": 8},
            "ep=3 does not divide dp=4 × cp=2: expert parallelism splits the experts over ranks of one shard group",
        ),
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


@pytest.mark.parametrize("tp, pp, dp, cp", LAYOUTS_8)
def test_rank_arithmetic_matches_row_major_grid(tp: int, pp: int, dp: int, cp: int) -> None:
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, cp=cp, world_size=8)
    grid = torch.arange(8).view(pp, dp, cp, tp)  # DeviceMesh's layout
    for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        assert dims.rank_of(p, d, c, t) == grid[p, d, c, t].item()
        assert dims.coords_of(grid[p, d, c, t].item()) == (p, d, c, t)
        assert dims.with_tp_rank(grid[p, d, c, t].item(), 0) == grid[p, d, c, 0].item()


def test_groups_need_build() -> None:
    dims = ParallelDims(tp=2, world_size=2)
    with pytest.raises(RuntimeError, match=r"call build\(\) first"):
        _ = dims.tp_group
    with pytest.raises(RuntimeError, match=r"call build\(\) first"):
        _ = dims.pp_rank


# ---------------------------------------------------------------------------
# Built on gloo ranks
# ---------------------------------------------------------------------------


def _expected(tp: int, pp: int, dp: int, cp: int, world: int) -> dict:
    """Per rank: coordinates and member lists, by enumerating the grid (axes pp, dp, cp, tp)."""
    coords = list(itertools.product(range(pp), range(dp), range(cp), range(tp)))  # index = rank
    rank = dist.get_rank()
    p, d, c, t = coords[rank]

    def same(*axes: int) -> list[int]:
        return [r for r, x in enumerate(coords) if all(x[a] == coords[rank][a] for a in axes)]

    members = {"tp": same(0, 1, 2), "dp": same(0, 2, 3), "pp": same(1, 2, 3), "mp": same(1, 2)}
    if cp > 1:
        members |= {"cp": same(0, 1, 3), "dp_cp": same(0, 3)}
    if pp > 1 and p in (0, pp - 1):
        members["embedding"] = [r for r in same(1, 2, 3) if coords[r][0] in (0, pp - 1)]
    stage = {x[0]: r for r, x in enumerate(coords) if x[1:] == (d, c, t)}
    return {
        "coords": (p, d, c, t),
        "members": members,
        "prev": stage.get(p - 1),
        "next": stage.get(p + 1),
    }


def _check_layout(tp: int, pp: int, dp: int, cp: int = 1) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, cp=cp).build("cpu")
    context = f" cp={cp}" if cp > 1 else ""
    assert dims.world_size == world and str(dims) == f"tp={tp}{context} pp={pp} dp={dp} (world {world})"
    exp = _expected(tp, pp, dp, cp, world)

    assert dims.mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert dims.mesh.mesh.tolist() == torch.arange(world).view(pp, dp, cp, tp).tolist()
    assert (dims.pp_rank, dims.dp_rank, dims.cp_rank, dims.tp_rank) == exp["coords"]
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
    if cp > 1:
        groups |= {"cp": dims.cp_group, "dp_cp": dims.dp_cp_group}
        assert dims.dp_shard_group is dims.dp_cp_group and dims.context.ring is dims.cp_group
    else:
        assert dims.dp_cp_group is dims.dp_group and dims.context.cp is None
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


def _check_layouts(layouts: list[tuple[int, int, int, int]]) -> list[dict]:
    out = [_check_layout(*layout) for layout in layouts]
    assert accounting.group_name(None) == "world"  # no dimension relabelled WORLD
    return out


def test_layouts_on_8_ranks() -> None:
    """All five layouts coexist in one 8-rank job (each builds its own groups)."""
    results = run_distributed(_check_layouts, 8, LAYOUTS_8, timeout=300)
    for i, (tp, pp, dp, cp) in enumerate(LAYOUTS_8):
        coords = [r[i]["coords"] for r in results]
        assert coords == list(itertools.product(range(pp), range(dp), range(cp), range(tp)))
        for (p, _, _, _), r in zip(coords, results):
            with_embedding = pp > 1 and p in (0, pp - 1)
            context = ["cp", "dp_cp"] if cp > 1 else []
            assert r[i]["labels"] == sorted(["tp", "pp", "dp", "mp", *context] + ["embedding"] * with_embedding)


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
        _, dp_rank, _, tp_rank = r["coords"]
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


def _context_layout() -> dict:
    """dp=2 × cp=4 with all-to-all runs of 2 (hybrid), ep=4 and ZeRO shards of dp_shard=1."""
    dims = ParallelDims(cp=4, cp_a2a=2, dp_shard=1, ep=4).build("cpu")
    ranks = dist.get_process_group_ranks
    ctx = dims.context
    return {
        "str": str(dims),
        "mode": ctx.mode,
        "cp": ranks(dims.cp_group),
        "a2a": ranks(ctx.a2a),
        "ring": ranks(ctx.ring),
        "dp_cp": ranks(dims.dp_cp_group),
        "shard": ranks(dims.dp_shard_group),
        "replicate": ranks(dims.dp_replicate_group),
        "ep": ranks(dims.ep_group),
        "aux": ranks(dims.expert_groups.dp),
        "labels": [accounting.group_name(g) for g in (ctx.a2a, ctx.ring, dims.dp_cp_group, dims.dp_shard_group)],
    }


def test_context_groups_compose_with_hybrid_sharding_and_experts() -> None:
    """On 8 ranks dp=2 cp=4: cp groups {0..3} {4..7}; hybrid all-to-all runs of 2 and rings
    of the ranks at the same place in them; parameters shared by dp × cp (all 8), ZeRO shards
    inside a replica (its 4 cp ranks), the replicas reduce across; ep borrows the 4 cp ranks;
    the MoE statistics span every rank reading other tokens (dp × cp)."""
    results = run_distributed(_context_layout, 8)
    for rank, r in enumerate(results):
        base = rank - rank % 4
        assert r["str"] == "tp=1 cp=4 (all-to-all 2) pp=1 dp=2 (2×1) ep=4 (world 8)" and r["mode"] == "hybrid"
        assert r["cp"] == list(range(base, base + 4))
        assert r["a2a"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["ring"] == [base + rank % 2, base + rank % 2 + 2]
        assert r["dp_cp"] == list(range(8)) and r["aux"] == list(range(8))
        assert r["shard"] == r["cp"] and r["ep"] == r["cp"]
        assert r["replicate"] == [rank % 4, rank % 4 + 4]
        assert r["labels"] == ["cp_a2a", "cp_ring", "dp_cp", "dp_shard"]
