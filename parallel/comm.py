"""The collectives: every collective in zero3d goes through these wrappers, which count it
(`parallel.accounting`, inside a ``tracking()`` block) and note it in the flight recorder
(`parallel.flight`) before issuing it.

A group of size 1 counts the call, with 0 bytes, but calls no torch.distributed: the
result is a local copy (all-gather, reduce-scatter, all-to-all, all_gather_object) or
nothing to do (all-reduce, broadcast, barrier), and ``async_op=True`` returns an already
completed ``dist.Work``. On gloo with CPU tensors, gloo's all-gather and reduce-scatter
run on a freshly allocated buffer of the full size (page faults included) and copy the
result out of it; there all-gather runs instead as N broadcasts into the pieces of the
output, and a reduce-scatter whose caller passes ``reuse_input=True`` as an all-reduce in
place. Each is still one call, with the bytes of the accounting's table.

The wrappers take torch's arguments (``reduce_scatter_tensor`` also ``reuse_input``) and
return what torch returns: None, or for ``async_op=True`` a ``dist.Work`` whose ``wait()``
comes before the output is read. When no ``tracking()`` is active, the cost over torch is
one test plus the flight recorder's note.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from parallel import accounting, flight

Group = dist.ProcessGroup | None

__all__ = [
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "irecv",
    "isend",
    "recv",
    "reduce_scatter_tensor",
    "send",
]


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------

_RUNS_ON = {"nccl": ("cuda",), "gloo": ("cpu", "cuda")}  # the devices each backend's collectives take


def _issue(group: Group, op: str, nbytes: int, tensors: list[torch.Tensor], channel: str | None = None) -> None:
    """Before a collective is issued: its tensors checked (`_placed`) and the call noted in the
    flight recorder (``channel``: a p2p pair's)."""
    _placed(group, op, *tensors)
    flight.note(group, op, nbytes, channel)


def _count_ring(group: Group, op: str, tensor: torch.Tensor, rounds: int = 1) -> None:
    """While tracking: one call of `op` with `tensor` as payload and the ring's wire bytes
    (`accounting.ring_bytes` of `rounds` passes)."""
    if accounting.recording():
        s = accounting.nbytes(tensor)
        accounting.record(group, op, s, accounting.ring_bytes(group, rounds * s))


def _placed(group: Group, op: str, *tensors: torch.Tensor) -> None:
    """Refuse, in one sentence, a collective whose tensors are not on one device its backend
    runs on: a tensor made without the model's device lands on the default device (the CPU,
    or meta in tests/test_placement.py), which NCCL cannot take."""
    devices = {t.device for t in tensors}
    backend = str(dist.get_backend(group))
    allowed = _RUNS_ON.get(backend)
    if len(devices) > 1 or (allowed is not None and next(iter(devices)).type not in allowed):
        where = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"{op} on group {accounting.group_name(group)} ({backend}) got tensors on {where}: every tensor of a "
            f"collective must be on one of {', '.join(allowed or ('one device',))}; create it on the model's "
            "device (device=param.device)"
        )


def _renamed(name: str, old_name: str) -> Any:
    """``torch.distributed.<name>``, or ``<old_name>`` where torch predates the name: torch
    2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
    reduce_scatter_single (same signature) and deprecated the old names, which are all that
    torch 2.11 has."""
    return getattr(dist, name, None) or getattr(dist, old_name)


class _Completed(dist.Work):
    """A ``dist.Work`` that is already done: ``async_op=True`` of a collective run locally."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


class _AllOf(dist.Work):
    """Several ``dist.Work`` as one: done when all are; ``wait`` waits for each in turn, then
    runs ``then`` (once), which finishes the result."""

    def __init__(
        self, works: list[dist.Work], result: list[torch.Tensor], then: Callable[[], None] | None = None
    ) -> None:
        super().__init__()
        self._works, self._result, self._then = works, result, then

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait() if timeout is None else w.wait(timeout)
        then, self._then = self._then, None
        if then is not None:
            then()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(lambda _: self._result)


def _alone(group: Group) -> bool:
    """The group is this rank alone: its collectives are local copies or nothing, on the
    caller's stream (tests/test_cuda.py turns this off to send them through NCCL)."""
    return dist.get_world_size(group) == 1


def _local(async_op: bool, *outputs: torch.Tensor) -> dist.Work | None:
    """What torch returns for a collective that is already done."""
    return _Completed(list(outputs)) if async_op else None


def _copy(output: torch.Tensor, input: torch.Tensor) -> None:
    """output := input (as many elements), nothing when both are the same memory."""
    if output.data_ptr() != input.data_ptr():
        output.copy_(input.reshape(output.shape))


def _gloo_cpu(group: Group, tensor: torch.Tensor) -> bool:
    """The collective on ``tensor`` runs on gloo, in host memory."""
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def _unless_async(work: dist.Work, async_op: bool) -> dist.Work | None:
    """What torch returns: `work` for async_op, else None once it is done."""
    if async_op:
        return work
    work.wait()
    return None


def _all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group: Group, n: int) -> dist.Work:
    """The exact all-gather as N broadcasts, group rank r's ``input`` into piece r of
    ``output`` (contiguous), with no buffer of its own; this rank's piece is copied first."""
    pieces = output.view(n, -1)
    _copy(pieces[dist.get_rank(group)], input)
    works = [dist.broadcast(pieces[r], group=group, async_op=True, group_src=r) for r in range(n)]
    return _AllOf(works, [output])


def _reduce_scatter_in_place(
    output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp.RedOpType, group: Group, n: int
) -> dist.Work:
    """The reduce-scatter as an all-reduce in place in ``input`` (contiguous); ``wait()`` then
    copies this rank's shard into ``output`` (nothing when ``output`` is that shard)."""
    work = dist.all_reduce(input, op=op, group=group, async_op=True)
    shard = input.view(n, -1)[dist.get_rank(group)]
    return _AllOf([work], [output], then=lambda: _copy(output, shard))


@accounting.timed
def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> dist.Work | None:
    """In-place all-reduce. bytes = 2·S·(N−1)/N, payload = S."""
    _issue(group, "all_reduce", accounting.nbytes(tensor), [tensor])
    work = _local(async_op, tensor) if _alone(group) else dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    _count_ring(group, "all_reduce", tensor, rounds=2)
    return work


@accounting.timed
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    reuse_input: bool = False,
) -> dist.Work | None:
    """Reduce ``input`` (N·shard) over the group; rank i keeps shard i in ``output``.
    ``reuse_input``: the caller does not read ``input`` again, so on gloo with CPU tensors
    the reduction runs as an all-reduce in place in ``input`` (gloo's own reduce-scatter
    all-reduces a fresh copy of ``input``, then copies shard i out of it) and ``wait()``
    copies shard i into ``output``. bytes = S_in·(N−1)/N, payload = S_in."""
    _issue(group, "reduce_scatter_tensor", accounting.nbytes(input), [output, input])
    n = dist.get_world_size(group)
    if _alone(group):
        _copy(output, input)
        work = _local(async_op, output)
    elif reuse_input and _gloo_cpu(group, input):
        work = _unless_async(_reduce_scatter_in_place(output, input, op, group, n), async_op)
    else:
        work = _renamed("reduce_scatter_single", "reduce_scatter_tensor")(
            output, input, op=op, group=group, async_op=async_op
        )
    _count_ring(group, "reduce_scatter_tensor", input)
    return work


@accounting.timed
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> dist.Work | None:
    """Split ``input`` along dim 0 (into N equal parts, or ``input_split_sizes``) and send
    part j to rank j; ``output`` holds the part from each rank, in rank order (sized by
    ``output_split_sizes``). bytes = what leaves this rank (all parts but its own: S_in·(N−1)/N
    for equal parts), payload = S_in."""
    _issue(group, "all_to_all_single", accounting.nbytes(input), [output, input])
    if _alone(group):
        _copy(output, input)
        work = _local(async_op, output)
    else:
        work = dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
    if accounting.recording():
        s = accounting.nbytes(input)
        if input_split_sizes is None:
            sent = accounting.ring_bytes(group, s)
        else:
            row = s // max(input.shape[0], 1)
            sent = row * (sum(input_split_sizes) - input_split_sizes[dist.get_rank(group)])
        accounting.record(group, "all_to_all_single", s, sent)
    return work


@accounting.timed
def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Concatenate every rank's ``input`` into ``output`` (N·shard); on gloo with CPU tensors
    by N broadcasts (module docstring). bytes = S_out·(N−1)/N, payload = S_out."""
    _issue(group, "all_gather_into_tensor", accounting.nbytes(output), [output, input])
    n = dist.get_world_size(group)
    if _alone(group):
        _copy(output, input)
        work = _local(async_op, output)
    elif _gloo_cpu(group, output):
        work = _unless_async(_all_gather_by_broadcasts(output, input, group, n), async_op)
    else:
        work = _renamed("all_gather_single", "all_gather_into_tensor")(output, input, group=group, async_op=async_op)
    _count_ring(group, "all_gather_into_tensor", output)
    return work


@accounting.timed
def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False) -> dist.Work | None:
    """Copy ``tensor`` from global rank ``src`` to the group.
    bytes = S on src (N > 1), 0 elsewhere; payload = S on every rank."""
    _issue(group, "broadcast", accounting.nbytes(tensor), [tensor])
    work = (
        _local(async_op, tensor) if _alone(group) else dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    )
    if accounting.recording():
        s = accounting.nbytes(tensor)
        sends = dist.get_rank() == src and dist.get_world_size(group) > 1
        accounting.record(group, "broadcast", s, s if sends else 0)
    return work


@accounting.timed
def all_gather_object(obj: Any, group: Group = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order.
    bytes = P·(N−1), payload = P, with P = len(pickle.dumps(obj))."""
    flight.note(group, "all_gather_object", 0)
    n = dist.get_world_size(group)
    out: list[Any] = [None] * n
    if _alone(group):
        out[0] = pickle.loads(pickle.dumps(obj))  # a copy, as torch's
    else:
        dist.all_gather_object(out, obj, group=group)
    if accounting.recording():
        p = len(pickle.dumps(obj))
        accounting.record(group, "all_gather_object", p, p * (n - 1))
    return out


@accounting.timed
def barrier(group: Group = None) -> None:
    """Block until every rank of the group arrives. bytes = payload = 0."""
    flight.note(group, "barrier", 0)
    if not _alone(group):
        dist.barrier(group=group)
    if accounting.recording():
        accounting.record(group, "barrier", 0, 0)


@accounting.timed
def send(tensor: torch.Tensor, dst: int, group: Group = None) -> None:
    """Blocking send to global rank ``dst``. bytes = payload = S."""
    _issue(group, "send", accounting.nbytes(tensor), [tensor], flight.p2p_channel(dist.get_rank(), dst))
    dist.send(tensor, dst=dst, group=group)
    if accounting.recording():
        s = accounting.nbytes(tensor)
        accounting.record(group, "send", s, s)


@accounting.timed
def recv(tensor: torch.Tensor, src: int, group: Group = None) -> int:
    """Blocking receive from global rank ``src``; returns torch's sender rank.
    bytes = 0, payload = S."""
    _issue(group, "recv", accounting.nbytes(tensor), [tensor], flight.p2p_channel(src, dist.get_rank()))
    sender = dist.recv(tensor, src=src, group=group)
    if accounting.recording():
        accounting.record(group, "recv", accounting.nbytes(tensor), 0)
    return sender


@accounting.timed
def isend(tensor: torch.Tensor, dst: int, group: Group = None) -> dist.Work | None:
    """Non-blocking send to global rank ``dst``. bytes = payload = S."""
    _issue(group, "isend", accounting.nbytes(tensor), [tensor], flight.p2p_channel(dist.get_rank(), dst))
    work = dist.isend(tensor, dst=dst, group=group)
    if accounting.recording():
        s = accounting.nbytes(tensor)
        accounting.record(group, "isend", s, s)
    return work


@accounting.timed
def irecv(tensor: torch.Tensor, src: int, group: Group = None) -> dist.Work | None:
    """Non-blocking receive from global rank ``src``. bytes = 0, payload = S."""
    _issue(group, "irecv", accounting.nbytes(tensor), [tensor], flight.p2p_channel(src, dist.get_rank()))
    work = dist.irecv(tensor, src=src, group=group)
    if accounting.recording():
        accounting.record(group, "irecv", accounting.nbytes(tensor), 0)
    return work


@accounting.timed
def batch_isend_irecv(p2p_ops: list[dist.P2POp]) -> list[dist.Work]:
    """Issue ``dist.P2POp(dist.isend | dist.irecv, ...)`` ops together; each op is
    counted as one "isend" (bytes = S) or "irecv" (bytes = 0) under its group."""
    me = dist.get_rank()
    for p2p in p2p_ops:
        send = p2p.op is dist.isend
        pair = flight.p2p_channel(me, p2p.peer) if send else flight.p2p_channel(p2p.peer, me)
        _issue(p2p.group, "isend" if send else "irecv", accounting.nbytes(p2p.tensor), [p2p.tensor], pair)
    works = dist.batch_isend_irecv(p2p_ops)
    if accounting.recording():
        for p2p in p2p_ops:
            s = accounting.nbytes(p2p.tensor)
            if p2p.op is dist.isend:
                accounting.record(p2p.group, "isend", s, s)
            else:
                accounting.record(p2p.group, "irecv", s, 0)
    return works
