"""optim/quantize.py: block-wise int8 / int4 quantization stays within its error bound,
is exact on its grid, packs int4 two to a byte and keeps shapes, padding and dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optim.fused import triton_runs_on
from optim.quantize import (
    dequantize,
    max_error,
    pack_rows,
    pick_backend,
    quantize,
    reduce_scatter_quantized,
    unpack_rows,
)
from parallel import accounting
from tests.dist_utils import run_distributed
from tests.interpreted import run_interpreted


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
    with accounting.tracking() as log:
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


# ---- the Triton kernels against the torch reference -------------------------------------------
QUANT_CASES = [  # (dtype, bits, numel, block): padding, odd and non-power-of-two blocks
    (dtype, bits, numel, block)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for bits in (8, 4)
    for numel, block in ((5000, 2048), (1000, 64), (500, 96), (7, 32), (1, 2))
]


def ties(block: int, bits: int) -> torch.Tensor:
    """A block of fp32 values x whose x / s is exactly k + 1/2 for many k (s the block's
    scale): the round-half-to-even cases, all of them, that the block's first element allows."""
    levels = 2 ** (bits - 1) - 1
    amax = torch.tensor([float(levels)])
    s = amax * (1.0 / levels)
    k = torch.arange(block - 1, dtype=torch.float32) % (2 * levels) - levels
    candidates = (k + 0.5) * s
    exact = candidates * (1.0 / s) == k + 0.5
    return torch.cat([amax, torch.where(exact, candidates, 0.0)])


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def compare_backends(device: torch.device) -> dict[str, int]:
    """Quantize and dequantize by `triton` and `torch` on `device` for every case (and a block
    of ties, an all-zero block, a strided input), asserting bitwise equality."""
    g = torch.Generator().manual_seed(0)
    checked = {"cases": 0, "ties": 0}
    for dtype, bits, numel, block in QUANT_CASES:
        x = torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)
        x[: min(block, numel) // 2] = 0.0
        inputs = [x.to(dtype).to(device), x.view(1, -1).expand(2, -1)[:, ::2].to(dtype).to(device)]
        if numel >= 2 * block:
            tie = ties(block, bits)
            x[block : 2 * block] = tie
            checked["ties"] += int(((tie * (1.0 / tie[0]) * (2 ** (bits - 1) - 1)) % 1 == 0.5).sum())
            inputs.append(x.to(dtype).to(device))
        for inp in inputs:
            ref, fused = quantize(inp, block, bits, backend="torch"), quantize(inp, block, bits, backend="triton")
            assert bitwise(ref.scale, fused.scale) and bitwise(ref.data, fused.data), (dtype, bits, numel, block)
            assert bitwise(dequantize(ref, backend="torch"), dequantize(ref, backend="triton")), (dtype, bits, block)
            checked["cases"] += 1
    empty = quantize(torch.zeros(0, device=device), 64, 8, backend="triton")
    assert empty.data.numel() == 0 and dequantize(empty, backend="triton").numel() == 0
    return checked


def interpreter_report() -> dict[str, int]:
    """Run in a TRITON_INTERPRET=1 process: the kernels on CPU tensors."""
    return compare_backends(torch.device("cpu"))


@pytest.mark.slow
def test_triton_kernels_are_bitwise_the_torch_reference() -> None:
    checked = run_interpreted("tests.test_quantize", "interpreter_report")
    assert checked["cases"] >= 2 * len(QUANT_CASES) and checked["ties"] > 100, checked


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_are_bitwise_the_torch_reference_on_cuda() -> None:
    compare_backends(torch.device("cuda"))


def test_backend_choice() -> None:
    assert pick_backend(torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="unknown quantizer backend"):
        pick_backend(torch.device("cpu"), "cuda")
    if not triton_runs_on(torch.device("cpu")):
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            quantize(torch.ones(4), 2, backend="triton")


def test_float8_blocks_keep_each_value_to_its_e4m3_precision() -> None:
    """quantize_float8: each block's largest element lands on e4m3's 448; every element keeps
    a relative error of at most 2^-4 (3 mantissa bits), or near zero an absolute one of s·2^-10
    (half of e4m3's smallest subnormal step, 2^-9, times the block's scale s); packing keeps it
    bit for bit."""
    from optim.quantize import quantize_float8

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=g) * torch.logspace(-4, 2, 5000)
    q = quantize_float8(x.bfloat16(), 256)
    assert q.data.dtype == torch.float8_e4m3fn and q.nbytes == 5120 + 4 * 20
    back = dequantize(q).float()
    bound = torch.maximum(x.bfloat16().float().abs() * 2**-4, q.scale.repeat_interleave(256)[:5000] * 2**-10)
    assert bool(((back - x.bfloat16().float()).abs() <= bound * (1 + 1e-3)).all())
    assert dequantize(q).dtype == torch.bfloat16
    unpacked = unpack_rows(pack_rows(q, 1), 256, 8, float8=True)
    assert torch.equal(unpacked.data.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(
        unpacked.scale, q.scale
    )
