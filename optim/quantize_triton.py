"""ZeRO++'s block quantizer (`optim.quantize`) as Triton kernels of one pass each.

`quantize_`: one program per block of `block` elements reads the block once in its own
dtype, takes s = max|x| · (1/Q) and writes the block's fp32 scale and its values
q = clamp(round_half_even(x · (1 / max(s, tiny))), −Q, Q) as int8 (int4: two per byte, low nibble
first). `dequantize_`: one program per block reads the values and the scale and writes
q · s, rounded to nearest even into the output dtype. The arithmetic is the torch
reference's, operation for operation (correctly rounded division, ties to even), so the
results are bitwise equal to it; under TRITON_INTERPRET=1 they run on CPU tensors, which is
how that is tested without a GPU.
"""

from __future__ import annotations

import torch

from optim.fused import to_rne, triton

if triton is not None:
    import triton.language as tl

_WARPS = {8: 4, 4: 2}  # by bits: the fastest on an H200 (2^28 bf16 elements, 2-16 warps tried)


def quantize_(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block: int, bits: int, levels: int) -> None:
    """Fill `data` (int8 [blocks·block], or uint8 [blocks·block/2] for int4) and `scale`
    (fp32 [blocks]) from the flat contiguous `x`; the last block is zero-padded."""
    blocks = scale.numel()
    if blocks == 0:
        return
    _quantize_kernel[(blocks,)](
        x, data, scale, x.numel(), 1.0 / levels, torch.finfo(torch.float32).tiny,
        BLOCK=block, PADDED=triton.next_power_of_2(block), LEVELS=levels, INT4=bits == 4, num_warps=_WARPS[bits],
        enable_fp_fusion=False,  # x·(1/s) + 0.5 as two roundings, as torch computes it, not one fma
    )  # fmt: skip


def dequantize_(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, block: int, bits: int) -> None:
    """Fill the flat `out` (its first out.numel() elements of the blocks) with q · s."""
    blocks = scale.numel()
    if blocks == 0:
        return
    _dequantize_kernel[(blocks,)](
        data, scale, out, out.numel(),
        BLOCK=block, PADDED=triton.next_power_of_2(block), INT4=bits == 4, num_warps=_WARPS[bits],
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _round_half_even(v):
        """round(v) with ties to even, as torch.round: floor(v + 0.5), one less on an odd tie
        (v + 0.5 is exact for the |v| <= 2^22 that x / s can be)."""
        r = tl.floor(v + 0.5)
        odd_tie = ((r - v) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)
        return tl.where(odd_tie, r - 1.0, r)

    @triton.jit
    def _quantize_kernel(
        x_ptr, data_ptr, scale_ptr, numel, inv_levels, tiny,
        BLOCK: tl.constexpr, PADDED: tl.constexpr, LEVELS: tl.constexpr, INT4: tl.constexpr,
    ):  # fmt: skip
        """One block: its scale, then its values (int4: element pairs as [PADDED/2, 2] rows)."""
        row = tl.program_id(0).to(tl.int64)
        if INT4:
            pair = tl.arange(0, PADDED // 2)
            index = 2 * pair[:, None] + tl.arange(0, 2)[None, :]
        else:
            index = tl.arange(0, PADDED)
        offsets = row * BLOCK + index
        x = tl.load(x_ptr + offsets, mask=(index < BLOCK) & (offsets < numel), other=0.0).to(tl.float32)
        if INT4:  # noqa: SIM108 - a branch on a triton constexpr, kept as the compiler sees it
            amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        else:
            amax = tl.max(tl.abs(x), axis=0)
        s = amax * inv_levels
        q = _round_half_even(x * tl.div_rn(1.0, tl.maximum(s, tiny)))
        q = tl.minimum(tl.maximum(q, -LEVELS), LEVELS).to(tl.int32)
        tl.store(scale_ptr + row, s)
        if INT4:
            low, high = tl.split(q & 0xF)
            tl.store(data_ptr + row * (BLOCK // 2) + pair, (low | (high << 4)).to(tl.uint8), mask=pair < BLOCK // 2)
        else:
            tl.store(data_ptr + offsets, q.to(tl.int8), mask=index < BLOCK)

    @triton.jit
    def _dequantize_kernel(
        data_ptr, scale_ptr, out_ptr, numel,
        BLOCK: tl.constexpr, PADDED: tl.constexpr, INT4: tl.constexpr,
    ):  # fmt: skip
        """One block: q · s into the output dtype (int4: two's-complement nibbles)."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.load(scale_ptr + row)
        if INT4:
            pair = tl.arange(0, PADDED // 2)
            packed = tl.load(data_ptr + row * (BLOCK // 2) + pair, mask=pair < BLOCK // 2, other=0).to(tl.int32)
            q = tl.join(packed & 0xF, packed >> 4)
            q = tl.where(q > 7, q - 16, q)
            index = 2 * pair[:, None] + tl.arange(0, 2)[None, :]
        else:
            index = tl.arange(0, PADDED)
            q = tl.load(data_ptr + row * BLOCK + index, mask=index < BLOCK, other=0).to(tl.int32)
        offsets = row * BLOCK + index
        values = q.to(tl.float32) * s
        tl.store(out_ptr + offsets, to_rne(values, out_ptr.dtype.element_ty), mask=(index < BLOCK) & (offsets < numel))
