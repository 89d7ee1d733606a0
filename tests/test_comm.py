"""parallel/comm.py: per-group, per-op accounting of calls, payload and ring wire bytes."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from parallel import comm
from tests.dist_utils import run_distributed

F32 = 24 * 4  # bytes of the fp32 test tensor (24 elements: divisible by every N used here)
BF16 = 24 * 2


def _dp_tp_groups(dp: int, tp: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup, list[int]]:
    """tp innermost: rank = d·tp + t. Returns this rank's (dp group, tp group, dp ranks).
    new_group (not DeviceMesh) so that each group is its own object even when it spans
    the world; DeviceMesh would hand back WORLD itself for such a dim."""
    rank = dist.get_rank()
    tp_ranks = [[d * tp + t for t in range(tp)] for d in range(dp)]
    dp_ranks = [[d * tp + t for d in range(dp)] for t in range(tp)]
    tp_groups = [dist.new_group(r) for r in tp_ranks]
    dp_groups = [dist.new_group(r) for r in dp_ranks]
    return dp_groups[rank % tp], tp_groups[rank // tp], dp_ranks[rank % tp]


def _exercise(dp: int, tp: int) -> dict:
    """Every wrapper once or twice on dp / tp / world; checks results and return types."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_group, tp_group, dp_ranks = _dp_tp_groups(dp, tp)
    comm.set_group_name(dp_group, "dp")
    comm.set_group_name(tp_group, "tp")
    x = torch.full((24,), float(rank))

    with comm.tracking() as log:
        y = x.clone()
        assert comm.all_reduce(y, group=dp_group) is None
        assert torch.equal(y, torch.full((24,), float(sum(dp_ranks))))
        work = comm.all_reduce(y, group=dp_group, async_op=True)
        assert isinstance(work, dist.Work)
        work.wait()

        z = x.to(torch.bfloat16)
        comm.all_reduce(z, op=dist.ReduceOp.MAX, group=tp_group)
        assert z.max().item() == (rank // tp) * tp + tp - 1

        shard = torch.empty(24 // dp)
        comm.reduce_scatter_tensor(shard, torch.arange(24.0), group=dp_group)
        i = dp_ranks.index(rank)
        assert torch.equal(shard, dp * torch.arange(24.0)[i * 24 // dp : (i + 1) * 24 // dp])

        gathered = torch.empty(24)
        comm.all_gather_into_tensor(gathered, torch.full((24 // tp,), float(rank)), group=tp_group)
        tp_ranks = torch.arange(tp) + (rank // tp) * tp
        assert torch.equal(gathered, tp_ranks.repeat_interleave(24 // tp).float())

        y = x.clone()
        comm.broadcast(y, src=dp_ranks[0], group=dp_group)
        assert torch.equal(y, torch.full((24,), float(dp_ranks[0])))
        y = x.clone()
        comm.broadcast(y, src=0)
        assert torch.equal(y, torch.zeros(24))

        objs = comm.all_gather_object({"rank": rank}, group=tp_group)
        assert objs == [{"rank": (rank // tp) * tp + t} for t in range(tp)]
        assert comm.barrier(group=dp_group) is None
        comm.barrier()

        if world > 1:
            y = x.clone()
            if rank % 2 == 0:
                assert comm.send(y, dst=rank + 1) is None
            else:
                assert comm.recv(y, src=rank - 1) == rank - 1
                assert torch.equal(y, x - 1)
            y = torch.empty(24)
            works = [comm.isend(x, dst=(rank + 1) % world), comm.irecv(y, src=(rank - 1) % world)]
            for w in works:
                w.wait()
            assert torch.equal(y, torch.full((24,), float((rank - 1) % world)))
        if dp > 1:
            nxt, prv = dp_ranks[(i + 1) % dp], dp_ranks[(i - 1) % dp]
            y = torch.empty(24)
            ops = [
                dist.P2POp(dist.isend, x, nxt, dp_group),
                dist.P2POp(dist.irecv, y, prv, dp_group),
            ]
            for w in comm.batch_isend_irecv(ops):
                w.wait()
            assert torch.equal(y, torch.full((24,), float(prv)))

    stats = log.as_dict()
    for g, ops in stats.items():
        for op, entry in ops.items():
            assert log.total_bytes(g, op) == entry["bytes"] and log.calls(g, op) == entry["calls"]
        assert log.total_bytes(g) == sum(e["bytes"] for e in ops.values())
    assert log.calls(op="all_reduce") == 3
    assert log.total_bytes() == sum(e["bytes"] for ops in stats.values() for e in ops.values())
    return stats


def _entry(calls: int, payload: int, wire: int) -> dict[str, int]:
    return {"calls": calls, "bytes": wire, "payload_bytes": payload}


def _expected(rank: int, dp: int, tp: int) -> dict:
    """The module docstring's table, applied to what _exercise issues on ``rank``."""
    world = dp * tp
    obj = len(pickle.dumps({"rank": rank}))
    dp_src = rank % tp
    dp_stats = {
        "all_reduce": _entry(2, 2 * F32, 2 * (2 * F32 * (dp - 1) // dp)),
        "reduce_scatter_tensor": _entry(1, F32, F32 * (dp - 1) // dp),
        "broadcast": _entry(1, F32, F32 if rank == dp_src and dp > 1 else 0),
        "barrier": _entry(1, 0, 0),
    }
    if dp > 1:
        dp_stats |= {"isend": _entry(1, F32, F32), "irecv": _entry(1, F32, 0)}
    tp_stats = {
        "all_reduce": _entry(1, BF16, 2 * BF16 * (tp - 1) // tp),
        "all_gather_into_tensor": _entry(1, F32, F32 * (tp - 1) // tp),
        "all_gather_object": _entry(1, obj, obj * (tp - 1)),
    }
    world_stats = {
        "broadcast": _entry(1, F32, F32 if rank == 0 and world > 1 else 0),
        "barrier": _entry(1, 0, 0),
    }
    if world > 1:
        sender = rank % 2 == 0
        world_stats["send" if sender else "recv"] = _entry(1, F32, F32 if sender else 0)
        world_stats |= {"isend": _entry(1, F32, F32), "irecv": _entry(1, F32, 0)}
    return {"dp": dp_stats, "tp": tp_stats, "world": world_stats}


@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 1), (2, 2)], ids=["world1", "world2-dp2-tp1", "world4-dp2-tp2"])
def test_accounting_matches_ring_formulas(dp: int, tp: int) -> None:
    for rank, stats in enumerate(run_distributed(_exercise, dp * tp, dp, tp)):
        assert stats == _expected(rank, dp, tp), f"rank {rank}"


def _tracking_semantics() -> dict:
    t = torch.ones(4)
    comm.all_reduce(t)  # no log active: nothing records it
    with comm.tracking() as first:
        comm.all_reduce(t)
    with comm.tracking() as outer:
        comm.all_reduce(t)
        with comm.tracking() as inner:
            comm.barrier()
        comm.all_reduce(t)
    comm.all_reduce(t)  # after both blocks: recorded nowhere
    assert comm._log is None

    with pytest.raises(RuntimeError), comm.tracking():
        raise RuntimeError("an error inside a block still ends it")
    assert comm._log is None

    with comm.tracking() as resettable:
        comm.barrier()
        resettable.reset()
        assert resettable.as_dict() == {}
        comm.barrier()
    return {"first": first.as_dict(), "outer": outer.as_dict(), "inner": inner.as_dict(), "reset": resettable.as_dict()}


def test_tracking_off_sequential_and_nested() -> None:
    ar = _entry(1, 16, 16)  # N=2: 2·16·(2−1)/2
    bar = _entry(1, 0, 0)
    for out in run_distributed(_tracking_semantics, 2):
        assert out["first"] == {"world": {"all_reduce": ar}}
        assert out["outer"] == {"world": {"all_reduce": _entry(2, 32, 32), "barrier": bar}}
        assert out["inner"] == {"world": {"barrier": bar}}
        assert out["reset"] == {"world": {"barrier": bar}}


def _names() -> None:
    anon = dist.new_group([0, 1])
    described = dist.new_group([0, 1], group_desc="pipeline")
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    assert comm.group_name(None) == comm.group_name(dist.group.WORLD) == "world"
    assert comm.group_name(anon) == "ranks[0,1]"
    assert comm.group_name(described) == "pipeline"
    assert comm.group_name(mesh.get_group("dp")) == "mesh_dp"
    # A mesh dim spanning every rank is the world group itself (so at world size 1
    # all dims share one group, and one label).
    assert mesh.get_group("tp") is dist.group.WORLD
    comm.set_group_name(anon, "dp")
    comm.set_group_name(None, "everyone")
    assert comm.group_name(anon) == "dp"
    assert comm.group_name(dist.group.WORLD) == comm.group_name(mesh.get_group("tp")) == "everyone"


def test_group_names() -> None:
    run_distributed(_names, 2)


def _against_comm_debug_mode() -> None:
    rank = dist.get_rank()
    t, shard = torch.ones(8), torch.empty(4)
    # CommDebugMode (a TorchDispatchMode) sees plain c10d collectives: their
    # ProcessGroup methods dispatch the c10d ops allreduce_, _reduce_scatter_base_, ...
    with CommDebugMode() as seen, comm.tracking() as log:
        comm.all_reduce(t)
        comm.all_reduce(t, async_op=True).wait()
        comm.reduce_scatter_tensor(shard, t)
        comm.all_gather_into_tensor(t, shard)
        comm.broadcast(t, src=0)
    c10d = torch.ops.c10d
    assert seen.get_comm_counts() == {
        c10d.allreduce_: log.calls(op="all_reduce"),
        c10d._reduce_scatter_base_: log.calls(op="reduce_scatter_tensor"),
        c10d._allgather_base_: log.calls(op="all_gather_into_tensor"),
        c10d.broadcast_: log.calls(op="broadcast"),
    }
    assert seen.get_total_counts() == log.calls() == 5

    # What torch 2.13's CommDebugMode does not see: barrier (c10d.barrier is not in
    # its op set) and point-to-point ops. all_gather_object is two allgather_ to it
    # (the pickled sizes, then the padded bytes) and one call to us.
    with CommDebugMode() as blind, comm.tracking() as log:
        comm.barrier()
        if rank == 0:
            comm.send(t, dst=1)
        else:
            comm.recv(t, src=0)
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, torch.empty(8), peer)]
        for w in comm.batch_isend_irecv(ops):
            w.wait()
        comm.all_gather_object(rank)
    assert blind.get_comm_counts() == {c10d.allgather_: 2}
    assert log.calls() == 5 and log.calls(op="all_gather_object") == 1


def test_call_counts_match_comm_debug_mode() -> None:
    run_distributed(_against_comm_debug_mode, 2)
