"""optim/quantize.py: block-wise int8 / int4 quantization stays within its error bound,
is exact on its grid, packs int4 two to a byte and keeps shapes, padding and dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optim.quantize import dequantize, max_error, quantize, reduce_scatter_quantized
from parallel import comm
from tests.dist_utils import run_distributed


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


def _reduce_scatter(bits: int, two_level: bool) -> dict:
    """4 ranks as 2 nodes of 2: qgZ's reduce-scatter against the exact one, on values whose
    magnitude differs by rank and by shard."""
    rank = dist.get_rank()
    intra, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    inter, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    torch.manual_seed(rank)
    shard = 1000
    full = torch.randn(4, shard) * torch.tensor([1.0, 10.0, 0.1, 3.0])[:, None] * (rank + 1)
    exact = torch.empty(shard)
    dist.reduce_scatter_tensor(exact, full.reshape(-1).clone())
    out = torch.empty(shard)
    groups = (intra, inter) if two_level else (None, None)
    with comm.tracking() as log:
        steps = reduce_scatter_quantized(full.reshape(-1), out, *groups, bits, BLOCK_QGZ)
        for works in steps:
            for w in works:
                w.wait()
    # a quantized value errs by at most M / (2Q), M = max |value|: the node sum of k = 2 (or
    # all 4) sources, then each of the m = 2 partial sums, themselves at most k·M
    biggest = full.abs().max()
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    levels = 2 ** (bits - 1) - 1
    bound = (2 + 2 * 2 if two_level else 4) * biggest / (2 * levels)
    return {"err": float((out - exact).abs().max()), "bound": float(bound), "log": log.as_dict()}


BLOCK_QGZ = 256


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("two_level", [True, False])
def test_quantized_reduce_scatter_is_close_and_sends_a_quarter(bits: int, two_level: bool) -> None:
    """Error within the sum of the quantization bounds; bytes: inside the node 1 byte (int8)
    or 1/2 (int4) per element of the full buffer × (k−1)/k plus 4 per block of scales, across
    nodes the same of the node's partial sums (a k-th of the buffer) × (m−1)/m."""
    for r in run_distributed(_reduce_scatter, 4, bits, two_level):
        assert r["err"] <= r["bound"], r
        per = bits / 8
        numel = 4 * 1000
        if two_level:
            intra = 2 * (-(-numel // 2 // BLOCK_QGZ) * BLOCK_QGZ) * (per + 4 / BLOCK_QGZ)  # 2 rows, padded
            inter = 2 * (-(-1000 // BLOCK_QGZ) * BLOCK_QGZ) * (per + 4 / BLOCK_QGZ)
            sent = {g: ops["all_to_all_single"]["bytes"] for g, ops in r["log"].items()}
            assert sorted(sent.values()) == sorted([int(intra) // 2, int(inter) // 2]), sent
        else:
            whole = 4 * (-(-1000 // BLOCK_QGZ) * BLOCK_QGZ) * (per + 4 / BLOCK_QGZ)
            assert r["log"]["world"]["all_to_all_single"]["bytes"] == int(whole) * 3 // 4
