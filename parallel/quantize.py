"""Block-wise symmetric quantization to int8 or int4, the arithmetic of ZeRO++'s quantized
collectives (Wang et al. 2023: qwZ for weights, qgZ for gradients).

A flat tensor x is cut into blocks of `block` elements (the last one zero-padded). Block j
gets the scale s_j = max_i |x_i| / Q with Q = 2^(bits−1) − 1 (127 for int8, 7 for int4),
and each element the integer q_i = round(x_i / s_j) ∈ [−Q, Q]. Dequantization is q_i · s_j,
so the error per element is at most s_j / 2 = max|block| / (2Q) (an all-zero block has
s_j = 0 and is exact). int4 values are packed two to a byte (low nibble first, as two's
complement nibbles).

Bytes on the wire per element: 1 (int8) or 1/2 (int4), plus 4 per block for the fp32 scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (8, 4)


@dataclass(frozen=True)
class Quantized:
    """A quantized flat tensor: `data` (int8 values, or int4 pairs packed in uint8), one fp32
    `scale` per block, and what is needed to restore it."""

    data: torch.Tensor
    scale: torch.Tensor
    numel: int
    block: int
    bits: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized form (values and scales)."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


def _levels(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"bits={bits} is not one of {BITS}")
    return 2 ** (bits - 1) - 1


def quantize(x: torch.Tensor, block: int, bits: int = 8) -> Quantized:
    """`x` (any shape, floating) quantized block-wise over its flattened elements."""
    levels = _levels(bits)
    if block <= 0 or (bits == 4 and block % 2):
        raise ValueError(f"block={block} must be positive{' and even for int4' if bits == 4 else ''}")
    padded = _blocks(x, block)
    blocks = padded.shape[0]
    scale = padded.abs().amax(dim=1) / levels
    q = torch.round(padded / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-levels, levels)
    q = q.to(torch.int8)
    if bits == 4:
        nibbles = (q & 0xF).to(torch.uint8).view(blocks, block // 2, 2)
        q = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return Quantized(q.reshape(-1), scale, x.numel(), block, bits, x.dtype)


def dequantize(qx: Quantized) -> torch.Tensor:
    """The flat tensor `qx` stands for, in its original dtype (numel elements)."""
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


def dequantize_gathered_(out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, like: Quantized) -> None:
    """Write into `out` the concatenation of the tensors quantized like `like` (same numel,
    block and bits) whose `data` and `scale` were gathered end to end (an all-gather of each),
    one piece of `like.numel` elements per part, without building the concatenation first."""
    parts = out.numel() // like.numel
    pieces = zip(out.view(parts, -1), data.view(parts, -1), scale.view(parts, -1))
    for piece, d, s in pieces:
        piece.copy_(dequantize(Quantized(d, s, like.numel, like.block, like.bits, like.dtype)))
