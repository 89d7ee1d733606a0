"""parallel/quantize.py: block-wise int8 / int4 quantization stays within its error bound,
is exact on its grid, packs int4 two to a byte and keeps shapes, padding and dtypes."""

from __future__ import annotations

import pytest
import torch

from parallel.quantize import dequantize, max_error, quantize


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(4096, 256), (1000, 64), (7, 32), (1, 2)])
def test_error_per_element_is_within_half_a_step(bits: int, numel: int, block: int) -> None:
    g = torch.Generator().manual_seed(numel + bits)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)  # blocks of very different scales
    qx = quantize(x, block, bits)
    error = (dequantize(qx) - x).abs()
    bound = max_error(x, block, bits).repeat_interleave(block)[:numel]
    assert bool((error <= bound * (1 + 1e-6) + 1e-30).all()), float((error - bound).max())
    assert qx.data.dtype == (torch.int8 if bits == 8 else torch.uint8)
    blocks = -(-numel // block)
    assert qx.scale.shape == (blocks,) and qx.data.numel() == blocks * block * bits // 8
    assert qx.nbytes == blocks * block * bits // 8 + 4 * blocks


@pytest.mark.parametrize("bits", [8, 4])
def test_values_on_the_grid_and_zero_blocks_are_exact(bits: int) -> None:
    levels = 2 ** (bits - 1) - 1
    grid = torch.arange(-levels, levels + 1, dtype=torch.float32) * 0.5  # every level of scale 0.5
    x = torch.cat([grid, torch.zeros(grid.numel() + 1)])  # the second block is all zeros
    qx = quantize(x, grid.numel() + 1, bits)
    assert torch.equal(dequantize(qx), x)


def test_shape_dtype_and_bad_arguments() -> None:
    x = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    out = dequantize(quantize(x, 16))
    assert out.dtype == torch.bfloat16 and out.shape == (3 * 5 * 7,)
    torch.testing.assert_close(out.float(), x.reshape(-1).float(), atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="bits=2 is not one of"):
        quantize(x, 16, bits=2)
    with pytest.raises(ValueError, match="block=15 must be positive and even for int4"):
        quantize(x, 15, bits=4)
