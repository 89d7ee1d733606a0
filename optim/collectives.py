"""The all-gather of flat shards every ZeRO stage uses: after the step (stages 1-2, the
resident units of stage 3) and around each stage-3 unit's forward and backward. Exact, or,
with a block size, as ZeRO++ qwZ's int8 (or float8 e4m3) blocks with one fp32 scale each (`optim.quantize`),
values and scales packed into one call; the gather is started here and finished by whoever
next reads the parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from optim.buffers import FlatBucket
from optim.quantize import (
    Quantized,
    QuantizedGather,
    dequantize,
    pack_rows,
    quantize,
    quantize_float8,
    unpack_rows,
)
from parallel import comm


@dataclass
class ShardGather:
    """An all-gather of equal flat shards into `out`, in flight: exact, or as packed quantized
    blocks (`pack_rows`) when `like` (this rank's quantized shard) is set. `finish(keep)` waits and
    then writes the dequantized pieces into `out`, except piece `keep` (this rank's own, when
    `out` already holds it exactly); `wait()` only waits."""

    out: torch.Tensor
    works: list
    gathered: torch.Tensor | None = None  # quantized: [world, bytes of one packed shard]
    like: Quantized | None = None

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()
        self.works = []

    def finish(self, keep: int | None = None) -> None:
        self.wait()
        if self.like is None:
            return
        numel = self.like.numel
        like = self.like
        values = dequantize(unpack_rows(self.gathered, like.block, like.bits, like.float8)).view(
            self.gathered.shape[0], -1
        )
        for r, piece in enumerate(self.out.view(-1, numel)):
            if r != keep:
                piece.copy_(values[r, :numel])


def all_gather_shards(
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, qwz: QuantizedGather | None = None
) -> ShardGather:
    """Start gathering every rank's `shard` into `out`, their concatenation: exactly, or as
    `qwz`'s quantized blocks with fp32 scales (ZeRO++ qwZ), values and scales packed in one call."""
    if qwz is None:
        return ShardGather(out, [comm.all_gather_into_tensor(out, shard, group=group, async_op=True)])
    q = quantize_float8(shard, qwz.block) if qwz.float8 else quantize(shard, qwz.block)
    packed = pack_rows(q, 1)
    gathered = packed.new_empty(dist.get_world_size(group), packed.shape[1])
    work = comm.all_gather_into_tensor(gathered.view(-1), packed.view(-1), group=group, async_op=True)
    return ShardGather(out, [work], gathered, q)


def gather_flat(bucket: FlatBucket, shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full flat tensor of which `shard` (laid out like the bucket's master) is this
    rank's part: gathered where the stage shards optimizer state, `shard` itself otherwise. A
    collective: every rank of `group` must call it."""
    if not bucket.sharding.optimizer_state:
        return shard
    flat = torch.empty(bucket.numel, dtype=shard.dtype, device=shard.device)
    comm.all_gather_into_tensor(flat, shard, group=group)
    return flat
