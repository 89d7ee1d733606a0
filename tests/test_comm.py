"""parallel/comm.py: per-group, per-op accounting of calls, payload and ring wire bytes."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from parallel import accounting, comm, desync
from tests.dist_utils import forbid_collectives, run_distributed

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
    accounting.set_group_name(dp_group, "dp")
    accounting.set_group_name(tp_group, "tp")
    x = torch.full((24,), float(rank))

    with accounting.tracking() as log:
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
    with accounting.tracking() as first:
        comm.all_reduce(t)
    with accounting.tracking() as outer:
        comm.all_reduce(t)
        with accounting.tracking() as inner:
            comm.barrier()
        comm.all_reduce(t)
    comm.all_reduce(t)  # after both blocks: recorded nowhere
    assert not accounting.recording()

    with pytest.raises(RuntimeError), accounting.tracking():
        raise RuntimeError("an error inside a block still ends it")
    assert not accounting.recording()

    with accounting.tracking() as resettable:
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
    assert accounting.group_name(None) == accounting.group_name(dist.group.WORLD) == "world"
    assert accounting.group_name(anon) == "ranks[0,1]"
    assert accounting.group_name(described) == "pipeline"
    assert accounting.group_name(mesh.get_group("dp")) == "mesh_dp"
    # A mesh dim spanning every rank is the world group itself (so at world size 1
    # all dims share one group, and one label).
    assert mesh.get_group("tp") is dist.group.WORLD
    accounting.set_group_name(anon, "dp")
    accounting.set_group_name(None, "everyone")
    assert accounting.group_name(anon) == "dp"
    assert accounting.group_name(dist.group.WORLD) == accounting.group_name(mesh.get_group("tp")) == "everyone"


def test_group_names() -> None:
    run_distributed(_names, 2)


def _against_comm_debug_mode() -> None:
    rank = dist.get_rank()
    t, shard = torch.ones(8), torch.empty(4)
    # CommDebugMode (a TorchDispatchMode) sees plain c10d collectives: their
    # ProcessGroup methods dispatch the c10d ops allreduce_, _reduce_scatter_base_, ...
    with CommDebugMode() as seen, accounting.tracking() as log:
        comm.all_reduce(t)
        comm.all_reduce(t, async_op=True).wait()
        comm.reduce_scatter_tensor(shard, t)
        comm.all_gather_into_tensor(t, shard)
        comm.broadcast(t, src=0)
    c10d = torch.ops.c10d
    # On gloo with CPU tensors an all-gather is N broadcasts into the pieces of its output
    # (comm's docstring): one call to us, N broadcast_ to CommDebugMode.
    n = dist.get_world_size()
    assert seen.get_comm_counts() == {
        c10d.allreduce_: log.calls(op="all_reduce"),
        c10d._reduce_scatter_base_: log.calls(op="reduce_scatter_tensor"),
        c10d.broadcast_: log.calls(op="broadcast") + n * log.calls(op="all_gather_into_tensor"),
    }
    assert log.calls() == 5 and seen.get_total_counts() == 4 + n

    # What torch 2.13's CommDebugMode does not see: barrier (c10d.barrier is not in
    # its op set) and point-to-point ops. all_gather_object is two allgather_ to it
    # (the pickled sizes, then the padded bytes) and one call to us.
    with CommDebugMode() as blind, accounting.tracking() as log:
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


def _alone() -> dict:
    """Every wrapper on a group of one rank, with torch.distributed's collectives forbidden."""
    forbid_collectives()
    with accounting.tracking() as log:
        t = torch.arange(4.0)
        assert comm.all_reduce(t) is None and torch.equal(t, torch.arange(4.0))
        work = comm.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        assert isinstance(work, dist.Work) and work.is_completed() and work.is_success() and work.wait()
        assert work.get_future().value()[0] is t and work.result()[0] is t

        out = torch.zeros(4)
        comm.all_gather_into_tensor(out, t)  # a copy
        assert torch.equal(out, t)
        pieces = torch.zeros(1, 4)
        comm.all_gather_into_tensor(pieces, t, async_op=True).wait()  # [N, shard] output
        assert torch.equal(pieces[0], t)
        comm.all_gather_into_tensor(t, t[:4])  # the input is the output: nothing to do
        shard = torch.zeros(4)
        comm.reduce_scatter_tensor(shard, t)
        assert torch.equal(shard, t)
        comm.reduce_scatter_tensor(t[:4], t, async_op=True).wait()
        swapped = torch.zeros(4)
        comm.all_to_all_single(swapped, t)
        assert torch.equal(swapped, t)
        comm.broadcast(t, src=0)
        assert comm.broadcast(t, src=0, async_op=True).wait()
        obj = {"a": [1]}
        got = comm.all_gather_object(obj)
        assert got == [obj] and got[0] is not obj
        comm.barrier()
        assert torch.equal(t, torch.arange(4.0))
    return log.as_dict()


def test_group_of_one_runs_no_collective() -> None:
    """A group of one rank calls no torch.distributed collective: each wrapper does the local
    equivalent (a copy or nothing), returns a completed dist.Work for async_op=True, and is
    still counted, with 0 wire bytes."""
    stats = run_distributed(_alone, 1)[0]["world"]
    assert {op: e["calls"] for op, e in stats.items()} == {
        "all_reduce": 2,
        "all_gather_into_tensor": 3,
        "reduce_scatter_tensor": 2,
        "all_to_all_single": 1,
        "broadcast": 2,
        "all_gather_object": 1,
        "barrier": 1,
    }
    assert all(e["bytes"] == 0 for e in stats.values())
    assert stats["all_gather_into_tensor"]["payload_bytes"] == 3 * 16


def _gathers() -> list[list[float]]:
    """comm's all-gather on gloo (N broadcasts) on the world and on a group of the odd ranks:
    flat and [N, shard] outputs, an input that is this rank's piece of the output, async."""
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = dist.new_group([r for r in range(world) if r % 2])
    out = torch.zeros(3 * world)
    comm.all_gather_into_tensor(out, torch.full((3,), float(rank)))
    assert torch.equal(out, torch.arange(world).float().repeat_interleave(3))
    rows = torch.zeros(world, 2, dtype=torch.bfloat16)
    rows[rank] = rank + 1
    work = comm.all_gather_into_tensor(rows, rows[rank], async_op=True)
    assert isinstance(work, dist.Work)
    work.wait()
    assert work.is_completed() and torch.equal(rows, (torch.arange(world) + 1).bfloat16()[:, None].expand(world, 2))
    results = [out.tolist()]
    if rank % 2:
        n = dist.get_world_size(odd)
        sub = torch.zeros(2 * n)
        work = comm.all_gather_into_tensor(sub, torch.full((2,), float(rank)), group=odd, async_op=True)
        work.get_future().wait()
        results.append(sub.tolist())
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_on_gloo(world: int) -> None:
    results = run_distributed(_gathers, world)
    odd = [float(r) for r in range(world) if r % 2 for _ in range(2)]
    for rank, r in enumerate(results):
        assert r[1:] == ([odd] if rank % 2 else [])


def _reduce_scatters() -> list[list[float]]:
    """reduce_scatter_tensor with reuse_input=True (on gloo: an all-reduce in place) against
    the plain one: the same shards, into a separate output or into the input's own shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(4.0 * world) * (rank + 1)
    plain = torch.empty(4)
    comm.reduce_scatter_tensor(plain, full.clone())
    apart = torch.empty(4)
    work = comm.reduce_scatter_tensor(apart, full.clone(), async_op=True, reuse_input=True)
    assert isinstance(work, dist.Work)
    work.wait()
    inside = full.clone()
    comm.reduce_scatter_tensor(inside[4 * rank : 4 * rank + 4], inside, reuse_input=True)
    with accounting.tracking() as log:
        comm.reduce_scatter_tensor(torch.empty(4), full.clone(), reuse_input=True)
    assert log.as_dict() == {"world": {"reduce_scatter_tensor": _entry(1, 16 * world, 16 * (world - 1))}}
    assert torch.equal(apart, plain) and torch.equal(inside[4 * rank : 4 * rank + 4], plain)
    return plain.tolist()


def test_reduce_scatter_reusing_the_input() -> None:
    world = 2
    total = sum(range(1, world + 1))
    for rank, shard in enumerate(run_distributed(_reduce_scatters, world)):
        assert shard == [total * x for x in range(4 * rank, 4 * rank + 4)]


def watchdog_threads_after_unwatch() -> tuple[bool, bool]:
    """Whether the watchdog thread runs after watch(), and after unwatch()."""
    import threading

    def running() -> bool:
        return any(t.name == "zero3d-desync" and t.is_alive() for t in threading.enumerate())

    desync.watch(60.0, "advice")
    before = running()
    desync.unwatch()
    return before, running()


def test_unwatch_stops_the_detector_thread_before_python_finalizes() -> None:
    """The hang detector's thread is joined by unwatch() (also registered at exit): a daemon thread
    that finalization finds inside a store call aborts the process."""
    assert run_distributed(watchdog_threads_after_unwatch, 2) == [(True, False), (True, False)]


def _functional_on_meta() -> list[str]:
    from parallel import functional

    errors = []
    for call in (
        lambda x: functional.all_reduce(x, dist.group.WORLD.group_name),
        lambda x: functional.all_gather_dim0(x, dist.group.WORLD.group_name, False),
        lambda x: functional.reduce_scatter_dim0(x, dist.group.WORLD.group_name),
        lambda x: functional.all_to_all(x, dist.group.WORLD.group_name),
    ):
        try:
            call(torch.zeros(4, 2, device="meta"))
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_functional_collectives_refuse_meta_tensors_as_comm_does() -> None:
    """A meta tensor (one made without the model's device) given to a functional collective
    is refused in comm's sentence, not answered by the operator's shape function."""
    errors = run_distributed(_functional_on_meta, 2, timeout=60)[0]
    assert all("every tensor of a collective must be on one of" in e for e in errors), errors
