"""Canonical sharded optimizer state for ``torch.distributed.checkpoint`` (DCP).

ZeRO keeps each parameter as a flat range ``[start, end)`` of its row-major
flattening, inside a padded 1-D bucket shard. A checkpoint written in those
terms would depend on the bucket layout (dp size, stage, packing order). Here
every flat range is rewritten as a few axis-aligned boxes of the parameter's
true global shape, and the boxes become the shards of a ``ShardedTensor``. DCP
stores boxes by (offsets, sizes) and, on load, copies the overlap of each saved
box with each requested box, so a checkpoint saved under one layout loads under
any other without conversion.

``full_tensor`` gathers such a tensor whole on every rank and ``fill_from_full`` copies a
whole tensor's boxes into the local shards: a full, rank-independent state dict (accelerate's
save_state writes one from rank 0) is built and loaded with them.

``ShardedTensor`` warns that it is deprecated in favour of ``DTensor`` (torch 2.13),
but a DTensor placement (even-chunk ``Shard(dim)`` per mesh dim) cannot describe an
arbitrary flat range, and DCP still saves and loads ``ShardedTensor`` natively.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)

from parallel import comm

Box = tuple[list[int], list[int]]

# ShardedTensor is deprecated, but it is the one DCP type that holds arbitrary boxes (above).
warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Fewest boxes ``(offsets, sizes)`` covering flat ``[start, end)`` of a row-major ``shape``.

    With ``inner = prod(shape[1:])`` the range splits at row boundaries of dim 0
    into a head (suffix of row ``start // inner``), a middle of whole rows
    ``[ceil(start / inner), end // inner)`` (one box), and a tail (prefix of row
    ``end // inner``); head and tail recurse on ``shape[1:]``. A suffix or prefix
    of a ``k``-dim tensor needs at most ``k`` boxes, so any range needs at most
    ``2k - 1``. Boxes come in flat order and each is a contiguous flat run, so
    it is a reshape of a slice of the flat storage; no split of the range into
    such runs has fewer boxes. (Boxes that are not flat runs can be fewer, e.g.
    ``[1, 9)`` of ``(3, 4)`` is 2 of them, but would be strided, non-contiguous
    views, which ``ShardedTensor`` rejects.) A 0-dim ``shape`` is treated as ``[1]``.
    """
    shape = list(shape) or [1]
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"range [{start}, {end}) is outside a tensor of shape {shape} ({numel} elements)")
    return _boxes(shape, start, end)


def _boxes(shape: list[int], start: int, end: int) -> list[Box]:
    """Head, middle and tail boxes of flat ``[start, end)``, as in :func:`flat_range_boxes`."""
    if start >= end:
        return []
    if len(shape) == 1:
        return [([start], [end - start])]
    inner = math.prod(shape[1:])
    zeros = [0] * (len(shape) - 1)
    first_row, last_row = start // inner, end // inner
    if first_row == last_row:
        return _in_row(first_row, _boxes(shape[1:], start % inner, end % inner))
    out: list[Box] = []
    full_from = first_row
    if start % inner:
        out += _in_row(first_row, _boxes(shape[1:], start % inner, inner))
        full_from += 1
    if last_row > full_from:
        out.append(([full_from, *zeros], [last_row - full_from, *shape[1:]]))
    if end % inner:
        out += _in_row(last_row, _boxes(shape[1:], 0, end % inner))
    return out


def _in_row(row: int, boxes: list[Box]) -> list[Box]:
    """Lift boxes of ``shape[1:]`` into row ``row`` of ``shape`` (size 1 along dim 0)."""
    return [([row, *offsets], [1, *sizes]) for offsets, sizes in boxes]


def sharded_tensor_from_flat(
    global_shape: Sequence[int],
    local_pieces: list[tuple[int, torch.Tensor]],
    all_ranges: list[list[tuple[int, int]]],
    group: dist.ProcessGroup | None = None,
) -> ShardedTensor:
    """A ``ShardedTensor`` of ``global_shape`` whose local shards are views of ``local_pieces``.

    ``local_pieces``: ``(flat_start, t)`` with ``t`` 1-D, holding flat ``[flat_start, flat_start + t.numel())``
    of the parameter on this rank. ``all_ranges[r]``: the flat ranges that group rank ``r`` holds; together
    they must tile ``[0, prod(global_shape))``. Each range becomes the boxes of :func:`flat_range_boxes`; the
    shard of box ``b`` is ``t[lo : lo + prod(b.sizes)].view(b.sizes)`` with ``lo = flat(b.offsets) -
    flat_start``, so ``dcp.load`` writes straight into ``t``'s storage. The global metadata is built locally
    (no collective). Placements name the GLOBAL rank of group rank ``r``, which is what ``ShardedTensor``
    compares with ``dist.get_rank()``. A 0-dim shape has one box with empty offsets and sizes. A parameter
    with no elements gets one empty box on group rank 0, backed by a fresh empty tensor.
    """
    shape = list(global_shape)
    group = group if group is not None else dist.group.WORLD
    my_rank, dtype, device = _check_pieces(local_pieces, all_ranges, group)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    local_shards: list[Shard] = []
    metas: list[ShardMetadata] = []
    for r, ranges in enumerate(all_ranges):
        boxes = [box for s, e in ranges for box in flat_range_boxes(shape, s, e)]
        if not boxes and shape and math.prod(shape):
            # an empty box keeps the key in this rank's DCP plan: a rank without local
            # shards drops it, and DCP then mistakes the checkpoint for a pre-2.4 one. It
            # sits past the end of dim 0 so that save-plan dedup never confuses it with data.
            boxes = [([shape[0]] + [0] * (len(shape) - 1), [0, *shape[1:]])]
        placement = f"rank:{dist.get_global_rank(group, r)}/{device}"
        for box in boxes:
            offsets, sizes = box if shape else ([], [])  # a 0-dim tensor is one box without dims
            meta = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=placement)
            metas.append(meta)
            if r == my_rank:
                lo = sum(o * st for o, st in zip(offsets, strides))
                empty = math.prod(sizes) == 0
                view = torch.empty(sizes, dtype=dtype, device=device) if empty else _piece_view(local_pieces, lo, sizes)
                local_shards.append(Shard(view, meta))
    if math.prod(shape) == 0:
        meta = ShardMetadata([0] * len(shape), shape, f"rank:{dist.get_global_rank(group, 0)}/{device}")
        metas.append(meta)
        if my_rank == 0:
            local_shards.append(Shard(torch.empty(shape, dtype=dtype, device=device), meta))

    pinned = any(t.is_pinned() for _, t in local_pieces)
    props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False, pin_memory=pinned)
    st_meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(shape), tensor_properties=props)
    st = ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, st_meta, process_group=group)
    st.__class__ = MovableShardedTensor  # torch builds a plain ShardedTensor whatever the class asked
    return st


class MovableShardedTensor(ShardedTensor):
    """A ``ShardedTensor`` that ``.to()`` the CPU it is already on returns unchanged. torch's own
    ``.to("cpu:0")`` (accelerate's device on a multi-CPU run, moving optimizer state "to the
    device") sees another device than ``cpu``, copies nothing yet stamps ``cpu:0`` on the
    shards, and fails its own placement check."""

    def to(self, *args: object, **kwargs: object) -> ShardedTensor:  # type: ignore[override]
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        on_cpu = all(s.tensor.device.type == "cpu" for s in self.local_shards())
        same_dtype = dtype in (None, self.dtype) and not kwargs.get("copy", False)
        if device is not None and device.type == "cpu" and on_cpu and same_dtype:
            return self
        return super().to(*args, **kwargs)


def full_tensor(st: ShardedTensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The whole tensor ``st`` shards over ``group``, on every rank (a collective: one
    all-gather of each rank's local shards, packed and padded to the largest rank's)."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    metas = st.metadata().shards_metadata
    held = [[m for m in metas if dist.get_group_rank(group, m.placement.rank()) == r] for r in range(world)]
    sizes = [sum(math.prod(m.shard_sizes) for m in ms) for ms in held]
    mine = {tuple(s.metadata.shard_offsets): s.tensor for s in st.local_shards()}
    device = next(iter(mine.values())).device if mine else torch.device("cpu")
    packed = torch.zeros(max(sizes), dtype=st.dtype, device=device)
    at = 0
    for m in held[dist.get_rank(group)]:
        n = math.prod(m.shard_sizes)
        packed[at : at + n] = mine[tuple(m.shard_offsets)].reshape(-1)
        at += n
    everyone = torch.empty(world * packed.numel(), dtype=st.dtype, device=device)
    comm.all_gather_into_tensor(everyone, packed, group=group)
    full = torch.empty(st.size(), dtype=st.dtype, device=device)
    for r, ms in enumerate(held):
        at = r * packed.numel()
        for m in ms:
            n = math.prod(m.shard_sizes)
            if n:
                full[_box(m)] = everyone[at : at + n].view(m.shard_sizes)
            at += n
    return full


def fill_from_full(st: ShardedTensor, full: torch.Tensor) -> None:
    """Copy into each of ``st``'s local shards its box of ``full`` (the whole tensor)."""
    for shard in st.local_shards():
        if shard.tensor.numel():
            shard.tensor.copy_(full[_box(shard.metadata)])


def _box(meta: ShardMetadata) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes))


def _check_pieces(
    local_pieces: list[tuple[int, torch.Tensor]], all_ranges: list[list[tuple[int, int]]], group: dist.ProcessGroup
) -> tuple[int, torch.dtype, torch.device]:
    """This rank's index in `group`, and the dtype and device of its pieces, once the pieces
    are checked against `all_ranges` (ValueError saying what does not match)."""
    my_rank = dist.get_rank(group)
    if my_rank < 0:
        raise ValueError("this rank is not a member of `group`")
    n = dist.get_world_size(group)
    if len(all_ranges) != n:
        raise ValueError(f"all_ranges has {len(all_ranges)} entries but the group has {n} ranks")
    if any(t.dim() != 1 for _, t in local_pieces):
        raise ValueError("local pieces must be 1-D tensors")
    mine = sorted((s, s + t.numel()) for s, t in local_pieces if t.numel())
    if mine != sorted((s, e) for s, e in all_ranges[my_rank] if e > s):
        raise ValueError(f"local pieces {mine} do not match all_ranges[{my_rank}] = {all_ranges[my_rank]}")
    dtypes = {t.dtype for _, t in local_pieces}
    if len(dtypes) > 1:
        raise ValueError(f"local pieces mix dtypes {dtypes}")
    dtype = dtypes.pop() if dtypes else torch.float32
    devices = {t.device for _, t in local_pieces}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    return my_rank, dtype, device


def _piece_view(local_pieces: list[tuple[int, torch.Tensor]], lo: int, sizes: list[int]) -> torch.Tensor:
    """Detached view of flat ``[lo, lo + prod(sizes))`` as ``sizes``, from the piece that holds it."""
    n = math.prod(sizes)
    for s, t in local_pieces:
        if s <= lo and lo + n <= s + t.numel():
            return t.detach()[lo - s : lo - s + n].view(sizes)
    raise AssertionError(f"no local piece holds flat [{lo}, {lo + n})")


def tile_sharded_tensor(
    st: ShardedTensor, dim: int, parts: int, index: int, placement_of: Callable[[int, int], int]
) -> ShardedTensor:
    """``st`` as block ``index`` of a tensor ``parts`` times larger along ``dim``.

    The full tensor is the concatenation along ``dim`` of ``parts`` blocks shaped like
    ``st``, each sharded like ``st``: block ``p`` holds ``st``'s boxes shifted by
    ``p · st.size(dim)`` along ``dim``, on global rank ``placement_of(r, p)`` where ``r``
    is the global rank holding the box in ``st`` (so ``placement_of(r, index) == r``).
    This is how a tensor-parallel slice, itself sharded over data-parallel ranks, becomes
    a piece of the tp = 1 parameter. Empty boxes move past the end of the full dim 0, so
    they never share offsets with data. Local shards stay views of ``st``'s tensors.
    """
    shape = list(st.size())
    full = list(shape)
    full[dim] *= parts
    device = st.local_shards()[0].tensor.device if st.local_shards() else torch.device("cpu")

    def shifted(meta: ShardMetadata, p: int) -> ShardMetadata:
        offsets = list(meta.shard_offsets)
        if math.prod(meta.shard_sizes) == 0:
            offsets[0] = full[0]
        else:
            offsets[dim] += p * shape[dim]
        rank = placement_of(meta.placement.rank(), p)
        return ShardMetadata(offsets, list(meta.shard_sizes), f"rank:{rank}/{device}")

    metas = [shifted(m, p) for p in range(parts) for m in st.metadata().shards_metadata]
    local = [Shard(s.tensor, shifted(s.metadata, index)) for s in st.local_shards()]
    st_meta = ShardedTensorMetadata(
        shards_metadata=metas, size=torch.Size(full), tensor_properties=st.metadata().tensor_properties
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, st_meta)
