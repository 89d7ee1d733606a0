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

import itertools
from typing import Any

import torch

from optim.fused import TRITON_FLOATS, KernelVariant, kernel_signature, triton

if triton is not None:  # the kernels exist only with triton; without it quantize.py runs torch's reference
    import triton.language as tl

    from optim.fused import to_rne

_WARPS = {8: 4, 4: 2}  # by bits: the fastest on an H200 (2^28 bf16 elements, 2-16 warps tried)


def _launch(block: int, bits: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The constexprs (but quantize's LEVELS) and the options both kernels are launched with.
    No fp fusion: quantize computes x·(1/s) + 0.5 as two roundings, as torch does, not one fma
    (dequantize has no a·b + c to contract)."""
    constexprs = {"BLOCK": block, "PADDED": triton.next_power_of_2(block), "INT4": bits == 4}
    return constexprs, {"num_warps": _WARPS[bits], "enable_fp_fusion": False}


def quantize_(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block: int, bits: int, levels: int) -> None:
    """Fill `data` (int8 [blocks·block], or uint8 [blocks·block/2] for int4) and `scale`
    (fp32 [blocks]) from the flat contiguous `x`; the last block is zero-padded."""
    blocks = scale.numel()
    if blocks == 0:
        return
    constexprs, options = _launch(block, bits)
    _quantize_kernel[(blocks,)](
        x, data, scale, x.numel(), 1.0 / levels, torch.finfo(torch.float32).tiny, LEVELS=levels, **constexprs, **options
    )  # fmt: skip


def dequantize_(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, block: int, bits: int) -> None:
    """Fill the flat `out` (its first out.numel() elements of the blocks) with q · s."""
    blocks = scale.numel()
    if blocks == 0:
        return
    constexprs, options = _launch(block, bits)
    _dequantize_kernel[(blocks,)](data, scale, out, out.numel(), **constexprs, **options)


def triton_variants(block: int, levels: dict[int, int]) -> list[KernelVariant]:
    """The specializations `quantize_` and `dequantize_` launch for `block` and each bits ->
    levels, x or out fp32 / bf16 / fp16, with their launch options (under 2^31 elements)."""
    if triton is None:
        return []
    variants = []
    for (bits, level), dtype in itertools.product(levels.items(), TRITON_FLOATS):
        constexprs, options = _launch(block, bits)
        common = {"data_ptr": "*u8" if bits == 4 else "*i8", "scale_ptr": "*fp32", "numel": "i32"}
        quantize = kernel_signature(_quantize_kernel, {**common, "x_ptr": f"*{dtype}"})
        dequantize = kernel_signature(_dequantize_kernel, {**common, "out_ptr": f"*{dtype}"})
        variants += [
            KernelVariant(
                _quantize_kernel, f"x={dtype} bits={bits}", quantize, {**constexprs, "LEVELS": level}, options
            ),
            KernelVariant(_dequantize_kernel, f"out={dtype} bits={bits}", dequantize, constexprs, options),
        ]
    return variants


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
        """One block: its scale, then its values (int4: element pairs as [PADDED/2, 2] rows of the
        values, reshaped after one contiguous load so the load stays 128-bit vectorized)."""
        row = tl.program_id(0).to(tl.int64)
        index = tl.arange(0, PADDED)
        offsets = row * BLOCK + index
        x = tl.load(x_ptr + offsets, mask=(index < BLOCK) & (offsets < numel), other=0.0).to(tl.float32)
        s = tl.max(tl.abs(x), axis=0) * inv_levels
        q = _round_half_even(x * tl.div_rn(1.0, tl.maximum(s, tiny)))
        q = tl.minimum(tl.maximum(q, -LEVELS), LEVELS).to(tl.int32)
        tl.store(scale_ptr + row, s)
        if INT4:
            pair = tl.arange(0, PADDED // 2)
            low, high = tl.split(tl.reshape(q & 0xF, (PADDED // 2, 2)))
            tl.store(data_ptr + row * (BLOCK // 2) + pair, (low | (high << 4)).to(tl.uint8), mask=pair < BLOCK // 2)
        else:
            tl.store(data_ptr + offsets, q.to(tl.int8), mask=index < BLOCK)

    @triton.jit
    def _dequantize_kernel(
        data_ptr, scale_ptr, out_ptr, numel,
        BLOCK: tl.constexpr, PADDED: tl.constexpr, INT4: tl.constexpr,
    ):  # fmt: skip
        """One block: q · s into the output dtype (int4: two's-complement nibbles, unpacked as
        [PADDED/2, 2] pairs and flattened, so the store stays 128-bit vectorized)."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.load(scale_ptr + row)
        index = tl.arange(0, PADDED)
        if INT4:
            pair = tl.arange(0, PADDED // 2)
            packed = tl.load(data_ptr + row * (BLOCK // 2) + pair, mask=pair < BLOCK // 2, other=0).to(tl.int32)
            q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (PADDED,))
            q = tl.where(q > 7, q - 16, q)
        else:
            q = tl.load(data_ptr + row * BLOCK + index, mask=index < BLOCK, other=0).to(tl.int32)
        offsets = row * BLOCK + index
        values = q.to(tl.float32) * s
        tl.store(out_ptr + offsets, to_rne(values, out_ptr.dtype.element_ty), mask=(index < BLOCK) & (offsets < numel))
