"""Context-parallel attention equals single-device attention: the zigzag's chunks and
blocks, the log-sum-exp merge, and the ring / all-to-all / hybrid attention's output and
gradients on gloo ranks (causal and sliding-window, at every chunk boundary)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.context import ContextGroups, kernels, positions
from parallel.context.chunks import Block, block_kind, block_mask
from tests.conftest import slow_except
from tests.dist_utils import run_distributed


def _reference(q, k, v, window):
    s = q.shape[-2]
    i = torch.arange(s, device=q.device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


@pytest.mark.parametrize("ring, a2a", [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (3, 2)])
def test_every_token_is_held_once_and_the_ring_pairs_are_balanced(ring: int, a2a: int) -> None:
    s = 2 * ring * a2a * 3
    held = [positions(s, ring, g, a2a, i) for g in range(ring) for i in range(a2a)]
    assert sorted(torch.cat(held).tolist()) == list(range(s))
    assert {len(p) for p in held} == {s // (ring * a2a)}
    c = s // (2 * ring)
    causal_work = [sum(int(t) // c + 1 for t in torch.cat(held[g * a2a : (g + 1) * a2a])) for g in range(ring)]
    assert len(set(causal_work)) == 1  # the zigzag: every ring member the same causal blocks


def test_the_zigzag_of_four() -> None:
    assert [positions(16, 4, g).tolist() for g in range(4)] == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    assert positions(16, 1, 0, 4, 1).tolist() == [4, 5, 6, 7]  # all-to-all: contiguous pieces


def test_a_length_that_does_not_split_is_refused() -> None:
    with pytest.raises(ValueError, match="does not split into 2·4 ring chunks"):
        positions(20, 4, 0)


@pytest.mark.parametrize("window", [None, 1, 3, 4, 5, 8, 9, 13])
def test_block_kinds_match_the_mask(window: int | None) -> None:
    c = 4
    for q_chunk, k_chunk in itertools.product(range(4), repeat=2):
        kind = block_kind(q_chunk, k_chunk, c, window)
        mask = block_mask(q_chunk, k_chunk, c, window, torch.device("cpu"))
        expected = {
            0: Block.SKIP,
            c * c: Block.FULL,
        }.get(
            int(mask.sum()),
            Block.CAUSAL if torch.equal(mask, torch.ones(c, c, dtype=torch.bool).tril()) else Block.MASKED,
        )
        assert kind is expected, (q_chunk, k_chunk, window)


@pytest.mark.parametrize("window", [None, 5])
def test_blocks_merged_by_log_sum_exp_equal_full_attention(window: int | None) -> None:
    torch.manual_seed(0)
    c, chunks = 4, 3
    q, k, v = (torch.randn(2, 3, c * chunks, 8, dtype=torch.float64) for _ in range(3))
    expected = _reference(q, k, v, window)
    for qi in range(chunks):
        out = lse = None
        for ki in reversed(range(chunks)):
            kind = block_kind(qi, ki, c, window)
            if kind is Block.SKIP:
                continue
            mask = block_mask(qi, ki, c, window, q.device) if kind is Block.MASKED else None
            part = slice(ki * c, (ki + 1) * c)
            query = q[..., qi * c : (qi + 1) * c, :]
            block_out, block_lse = kernels.forward(query, k[..., part, :], v[..., part, :], kind, mask, kernels.Saved())
            out, lse = kernels.merge(out, lse, block_out, block_lse)
        torch.testing.assert_close(out, expected[..., qi * c : (qi + 1) * c, :], rtol=1e-12, atol=1e-12)


def _context_groups(a2a: int) -> ContextGroups:
    """The world as one cp group: all-to-all inside runs of `a2a` ranks, the ring across."""
    world, rank = dist.get_world_size(), dist.get_rank()
    runs = [list(range(i, i + a2a)) for i in range(0, world, a2a)]
    rings = [list(range(i, world, a2a)) for i in range(a2a)]
    mine = {}
    for name, sets in (("a2a", runs), ("ring", rings)):
        for ranks in sets:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = group
    cp = dist.new_group(list(range(world)))
    return ContextGroups(cp, mine["a2a"] if a2a > 1 else None, mine["ring"] if a2a < world else None)


def _attention_on_ranks(a2a: int, window: int | None, s: int) -> float:
    torch.manual_seed(0)
    b, heads, d = 2, 4, 8
    q, k, v = (torch.randn(b, heads, s, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, heads, s, d, dtype=torch.float64)
    expected = _reference(q, k, v, window)
    expected.backward(dout)
    groups = _context_groups(a2a)
    mine = groups.positions(s)
    local = [x.detach()[..., mine, :].clone().requires_grad_() for x in (q, k, v)]
    out = groups.attention(*local, window, lambda q_, k_, v_: _reference(q_, k_, v_, window))
    out.backward(dout[..., mine, :])
    worst = 0.0
    for got, want in [(out, expected[..., mine, :])] + [
        (x.grad, y.grad[..., mine, :]) for x, y in zip(local, (q, k, v))
    ]:
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        worst = max(worst, float((got - want).abs().max()))
    return worst


@pytest.mark.parametrize(
    "world, a2a, window",
    slow_except(
        [(2, 1, None), (4, 2, 24)],
        [(2, 1, 24), (4, 1, None), (4, 1, 24), (4, 1, 5), (2, 2, None), (4, 4, 24), (4, 2, None), (4, 1, 64)],
    ),
)
def test_context_parallel_attention_equals_one_device(world: int, a2a: int, window: int | None) -> None:
    """Ring (a2a 1), all-to-all (a2a = world) and hybrid: output and q, k, v gradients equal
    full attention on the whole sequence at this rank's positions (fp64 inputs; blocks in fp32)."""
    run_distributed(_attention_on_ranks, world, a2a, window, 64)


def _ring_in_one_process(q, k, v, dout, ring: int, window: int | None):
    """Every ring member's work in one process (`ring.member_in_one_process`): the whole
    sequence's output and q, k, v gradients, as the ring computes them."""
    from parallel.context.ring import member_in_one_process

    where = [positions(q.shape[-2], ring, g) for g in range(ring)]
    kv = torch.stack((k, v))
    kvs = [kv[..., w, :] for w in where]
    acc = kernels.accumulator(q.dtype)
    out, dq, dkv = torch.empty_like(q), torch.zeros_like(q, dtype=acc), torch.zeros_like(kv, dtype=acc)
    for g in range(ring):
        mine, dq_g, dkvs = member_in_one_process(q[..., where[g], :], dout[..., where[g], :], kvs, g, window)
        out[..., where[g], :], dq[..., where[g], :] = mine, dq_g
        for w, part in zip(where, dkvs, strict=True):
            dkv[..., w, :] += part
    return out, dq, dkv[0], dkv[1]


CUDA = pytest.mark.skipif("not torch.cuda.is_available()", reason="needs CUDA")


@pytest.mark.parametrize(
    "device, dtype, tolerance",
    [("cpu", torch.float64, 1e-10), pytest.param("cuda", torch.bfloat16, 3e-2, marks=(pytest.mark.cuda, CUDA))],
)
@pytest.mark.parametrize("window", [None, 40])
def test_the_ring_blocks_on_the_device_kernels_equal_causal_attention(device, dtype, tolerance, window) -> None:
    """On CUDA in bf16 the blocks run on the fused flash / memory-efficient kernels (the
    window's edge on the efficient kernel's mask), on the CPU on the fp64 math: either way
    the ring's output and gradients are causal attention's (bf16: within its rounding)."""
    torch.manual_seed(0)
    shape = (1, 2, 256, 64)
    q, k, v, dout = (torch.randn(shape, dtype=torch.float64).to(device, dtype) for _ in range(4))
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = _reference(*leaves, window)
    expected.backward(dout.double())
    got = _ring_in_one_process(q, k, v, dout, 4, window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (expected, *(x.grad for x in leaves))):
        torch.testing.assert_close(a.double(), b, rtol=tolerance, atol=tolerance, msg=lambda m, n=name: f"{n}: {m}")
