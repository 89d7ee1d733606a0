"""Block-wise symmetric quantization to int8 or int4, the arithmetic of ZeRO++'s quantized
collectives (Wang et al. 2023: qwZ for weights, qgZ for gradients).

A flat tensor x is cut into blocks of `block` elements (the last one zero-padded). Block j
gets the scale s_j = max_i |x_i| · fp32(1/Q) with Q = 2^(bits−1) − 1 (127 for int8, 7 for int4),
and each element the integer q_i = round(x_i · (1/s_j)) ∈ [−Q, Q] (one division per block). Dequantization is q_i · s_j,
so the error per element is at most s_j / 2 = max|block| / (2Q) (an all-zero block has
s_j = 0 and is exact). int4 values are packed two to a byte (low nibble first, as two's
complement nibbles).

Two implementations of the same arithmetic, bitwise equal: the torch reference (several
passes over the data) and one-pass Triton kernels (`optim.quantize_triton`), which
`backend=None` picks wherever Triton runs on the tensor's device (CUDA).

Bytes on the wire per element: 1 (int8) or 1/2 (int4), plus 4 per block for the fp32 scale;
the collectives send both in one call, each rank's piece padded to whole 4-byte words.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optim import quantize_triton
from optim.fused import KernelVariant, triton_runs_on
from parallel import comm

BITS = (8, 4)
BACKENDS = ("triton", "torch")


@dataclass(frozen=True)
class Quantized:
    """A quantized flat tensor: `data` (int8 values, int4 pairs packed in uint8, or float8
    e4m3 values), one fp32 `scale` per block, and what is needed to restore it."""

    data: torch.Tensor
    scale: torch.Tensor
    numel: int
    block: int
    bits: int
    dtype: torch.dtype
    float8: bool = False  # `data` is float8 e4m3 (`quantize_float8`), 8 bits

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized form (values and scales)."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


@dataclass(frozen=True)
class QuantizedGather:
    """How parameter all-gathers are quantized (ZeRO++ qwZ): blocks of `block` elements with
    fp32 scales, as int8 or, with `float8`, as float8 e4m3 (`quantize_float8`)."""

    block: int
    float8: bool = False


def _levels(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits={bits} is not one of {BITS}")
    return 2 ** (bits - 1) - 1


def triton_variants(block: int) -> list[KernelVariant]:
    """The Triton kernels' specializations for blocks of `block`, at each of BITS."""
    return quantize_triton.triton_variants(block, {bits: _levels(bits) for bits in BITS})


def pick_backend(device: torch.device, requested: str | None = None) -> str:
    """`requested` if it runs on `device`, else ValueError; None: triton on CUDA, else torch."""
    if requested is None:
        return "triton" if device.type == "cuda" and triton_runs_on(device) else "torch"
    if requested not in BACKENDS:
        raise ValueError(f"unknown quantizer backend {requested!r}; known: {', '.join(BACKENDS)}.")
    if requested == "triton" and not triton_runs_on(device):
        raise ValueError(f"the triton quantizer does not run on {device.type} (CPU needs TRITON_INTERPRET=1).")
    return requested


def quantize(x: torch.Tensor, block: int, bits: int = 8, backend: str | None = None) -> Quantized:
    """`x` (any shape, floating) quantized block-wise over its flattened elements."""
    levels = _levels(bits)
    if block <= 0 or (bits == 4 and block % 2):
        raise ValueError(f"block={block} must be positive{' and even for int4' if bits == 4 else ''}")
    if pick_backend(x.device, backend) == "triton":
        flat = x.detach().reshape(-1).contiguous()
        blocks = -(-flat.numel() // block)
        scale = torch.empty(blocks, dtype=torch.float32, device=x.device)
        dtype, width = (torch.uint8, block // 2) if bits == 4 else (torch.int8, block)
        data = torch.empty(blocks * width, dtype=dtype, device=x.device)
        quantize_triton.quantize_(flat, data, scale, block, bits, levels)
        return Quantized(data, scale, x.numel(), block, bits, x.dtype)
    padded = _blocks(x, block)
    blocks = padded.shape[0]
    scale = padded.abs().amax(dim=1) * (1.0 / levels)
    inverse = 1.0 / scale.clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(padded * inverse[:, None]).clamp_(-levels, levels)
    q = q.to(torch.int8)
    if bits == 4:
        nibbles = (q & 0xF).to(torch.uint8).view(blocks, block // 2, 2)
        q = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return Quantized(q.reshape(-1), scale, x.numel(), block, bits, x.dtype)


def quantize_float8(x: torch.Tensor, block: int) -> Quantized:
    """`x` as float8 e4m3 blocks: block j scaled by s_j = max|block| · fp32(1/448) so that its
    largest element lands on e4m3's largest, each element rounded to the nearest e4m3 value
    (a relative error of at most 2^-4, not a fixed step as int8's): what float8 training's
    parameter gathers send (`Communication`/`ZeroPlusPlus.qwz_float8`)."""
    if block <= 0:
        raise ValueError(f"block={block} must be positive")
    top = torch.finfo(torch.float8_e4m3fn).max
    padded = _blocks(x, block)
    scale = padded.abs().amax(dim=1) * (1.0 / top)
    inverse = 1.0 / scale.clamp_min(torch.finfo(torch.float32).tiny)
    q = (padded * inverse[:, None]).clamp_(-top, top).to(torch.float8_e4m3fn)
    return Quantized(q.reshape(-1), scale, x.numel(), block, 8, x.dtype, float8=True)


def dequantize(qx: Quantized, backend: str | None = None) -> torch.Tensor:
    """The flat tensor `qx` stands for, in its original dtype (numel elements)."""
    if qx.float8:
        values = qx.data.view(-1, qx.block).float() * qx.scale[:, None]
        return values.reshape(-1)[: qx.numel].to(qx.dtype)
    if pick_backend(qx.data.device, backend) == "triton":
        out = torch.empty(qx.numel, dtype=qx.dtype, device=qx.data.device)
        quantize_triton.dequantize_(qx.data, qx.scale, out, qx.block, qx.bits)
        return out
    blocks = qx.scale.numel()
    if qx.bits == 4:
        packed = qx.data.view(blocks, qx.block // 2)
        low = (packed & 0xF).to(torch.int8)
        high = (packed >> 4).to(torch.int8)
        q = torch.stack([low, high], dim=-1).view(blocks, qx.block)
        q = torch.where(q > 7, q - 16, q)  # two's-complement nibbles
    else:
        q = qx.data.view(blocks, qx.block)
    values = q.float() * qx.scale[:, None]
    return values.reshape(-1)[: qx.numel].to(qx.dtype)


def max_error(x: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    """The bound on |x − dequantize(quantize(x))| per element: max|block| / (2Q), per block."""
    return _blocks(x, block).abs().amax(dim=1) / (2 * _levels(bits))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x flattened to fp32 and zero-padded into rows of `block` elements."""
    flat = x.detach().reshape(-1).float()
    rows = -(-flat.numel() // block)
    padded = torch.zeros(rows * block, dtype=torch.float32, device=x.device)
    padded[: flat.numel()] = flat
    return padded.view(rows, block)


def pack_rows(q: Quantized, rows: int) -> torch.Tensor:
    """`q`, made of `rows` rows of whole blocks, as [rows, bytes] uint8: each row's fp32 scales,
    then its values, padded to whole 4-byte words so that the scales stay aligned wherever the
    row lands. One collective then carries values and scales (one latency, not two)."""
    scale = q.scale.view(rows, -1).view(torch.uint8)
    data = q.data.view(rows, -1).view(torch.uint8)
    pad = -(scale.shape[1] + data.shape[1]) % 4
    return torch.cat([scale, data, data.new_zeros(rows, pad)], dim=1)


def unpack_rows(packed: torch.Tensor, block: int, bits: int, float8: bool = False) -> Quantized:
    """The rows of `packed` (`pack_rows`'s layout) as one fp32 Quantized: a row of b blocks holds
    b·(4 + block·bits/8) bytes and less than one block's of padding."""
    rows, width = packed.shape
    blocks = width // (4 + block * bits // 8)
    scale = packed[:, : 4 * blocks].contiguous().view(torch.float32).reshape(-1)
    data = packed[:, 4 * blocks : 4 * blocks + blocks * block * bits // 8].contiguous()
    if bits == 8:
        data = data.view(torch.float8_e4m3fn if float8 else torch.int8)
    return Quantized(data.reshape(-1), scale, rows * blocks * block, block, bits, torch.float32, float8)


def reduce_scatter_quantized(
    full: torch.Tensor,
    out: torch.Tensor,
    intra: dist.ProcessGroup | None,
    inter: dist.ProcessGroup | None,
    bits: int,
    block: int,
) -> Iterator[list]:
    """ZeRO++ qgZ: out = Σ over the shard group of `full`'s shard s on shard rank s = a·k + j
    (node a of m, rank j of the k on each node), sent as `bits`-bit blocks: an all-to-all
    inside the node (rank j receives every node-peer's shards for local rank j and sums them
    in fp32), then one across nodes among the ranks j (each sums its own shard). A generator:
    it yields the works of each all-to-all and goes on once they are done. `inter` None:
    the shard group is inside one node."""
    k = dist.get_world_size(intra)
    m = dist.get_world_size(inter) if inter is not None else 1
    shard = full.numel() // (k * m)
    rows = full.view(m, k, shard).transpose(0, 1).reshape(k, m * shard)
    partial = (yield from exchange_quantized(rows, intra, bits, block)) if k > 1 else rows[0].float()
    if m > 1:
        partial = yield from exchange_quantized(partial.view(m, shard), inter, bits, block)
    out.copy_(partial)


def exchange_quantized(rows: torch.Tensor, group: dist.ProcessGroup | None, bits: int, block: int) -> Iterator[list]:
    """Σ_r (row i of rank r's `rows`) on group rank i: each row quantized on its own blocks,
    values and scales packed (`pack_rows`) into one all-to-all, summed in fp32 after dequantizing."""
    n, width = rows.shape
    padded_width = -(-width // block) * block
    padded = rows.new_zeros((n, padded_width), dtype=torch.float32)
    padded[:, :width] = rows
    q = quantize(padded, block, bits)
    packed = pack_rows(q, n)
    arrived = torch.empty_like(packed)
    yield [comm.all_to_all_single(arrived.view(-1), packed.view(-1), group=group, async_op=True)]
    values = dequantize(unpack_rows(arrived, block, bits))
    return values.view(n, padded_width)[:, :width].sum(0)
