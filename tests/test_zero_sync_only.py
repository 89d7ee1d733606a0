"""`ZeroOptimizer.sync_only(module)`: gradients reduced every micro-batch, one pipeline chunk
at a time. A model made of two chunks (a ModuleList, as a pipeline rank holds them) is run
chunk by chunk, each backward scoped to its chunk: the result equals single-process AdamW,
each backward reduces only its chunk's buckets, and stage 2-3 gradient memory stays near the
shards instead of holding every full bucket. Also: buckets never span chunks and come in the
order they complete; a backward that reaches outside its scope, or gradients left under
no_sync, are errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from optim import ZeroOptimizer
from optim.buffers import assign_buckets
from optim.policies import Communication
from parallel import accounting
from tests.dist_utils import run_distributed

WIDTH, MICRO, STEPS, ROWS = 16, 3, 4, 4  # ROWS per micro-batch per rank


def two_chunks() -> nn.ModuleList:
    torch.manual_seed(0)

    def chunk() -> nn.Sequential:
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH))

    return nn.ModuleList([chunk(), chunk()])


def batch(step: int, micro: int, rows: slice) -> torch.Tensor:
    return torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(100 * step + micro))[rows]


def chunked_backward(opt: ZeroOptimizer, model: nn.ModuleList, x: torch.Tensor, scope: str) -> float:
    """Forward through both chunks with a cut between them, then backward chunk 1 and chunk 0
    separately, as a pipeline does (Adam eps 1e-6: with 1e-8, rounding-level gradient differences of tiny
    gradients show in the update); `scope`: 'chunk' (sync_only), 'no_sync' or 'outside'."""
    h = model[0](x)
    h_in = h.detach().requires_grad_()
    loss = (model[1](h_in) - x.flip(-1)).square().mean() / MICRO
    context = {"chunk": opt.sync_only, "no_sync": lambda m: opt.no_sync(), "outside": lambda m: opt.sync_only(model[0])}
    with context[scope](model[1]):
        loss.backward()
    with opt.sync_only(model[0]):
        h.backward(h_in.grad)
    return float(loss.detach()) * MICRO


def train(stage: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = two_chunks()
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=stage,
        communication=Communication(bucket_numel=WIDTH * WIDTH, unit_numel=WIDTH * WIDTH, resident_numel=0),
        lr=1e-2,
        eps=1e-6,
    )
    chunk_buckets = [sum(any(p in set(c.parameters()) for p in b.params) for b in opt.buckets) for c in model]
    with accounting.tracking() as log:
        for step in range(STEPS):
            for micro in range(MICRO):
                chunked_backward(opt, model, batch(step, micro, slice(rank * ROWS, (rank + 1) * ROWS)), "chunk")
            opt.step()
            opt.zero_grad()
    return {
        "state": opt.full_state_dict(),
        "chunk_buckets": chunk_buckets,
        "buckets": len(opt.buckets),
        "reductions": log.calls(op="reduce_scatter_tensor"),
        "peak": opt.grad_peak_bytes,
        "shards": opt.memory_breakdown()["grads"],
    }


def reference(world: int) -> dict:
    model = two_chunks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    for step in range(STEPS):
        for micro in range(MICRO):
            x = batch(step, micro, slice(0, world * ROWS))
            ((model[1](model[0](x)) - x.flip(-1)).square().mean() / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_chunk_scoped_reduction_every_micro_batch_matches_torch(stage: int) -> None:
    out = run_distributed(train, 2, stage, timeout=120)[0]
    ref = reference(2)
    for k, v in ref.items():
        torch.testing.assert_close(out["state"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    # each scoped backward reduces its own chunk's buckets once, never the other chunk's
    assert sum(out["chunk_buckets"]) == out["buckets"]
    assert out["reductions"] == STEPS * MICRO * out["buckets"]


def test_stage2_every_micro_batch_holds_few_full_buckets() -> None:
    """Without scoping, accumulation holds every full bucket; scoped, a chunk's reductions
    retire as its backward goes, so the peak stays well under shards + everything."""
    out = run_distributed(train, 2, 2, timeout=120)[0]
    full = 2 * out["shards"]  # dp = 2
    assert out["shards"] < out["peak"] < out["shards"] + full


def misuse(case: str) -> str:
    model = two_chunks()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-2)
    try:
        chunked_backward(opt, model, batch(0, 0, slice(0, ROWS)), case)
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_backward_outside_its_scope_is_an_error() -> None:
    assert "scoped to other buckets" in run_distributed(misuse, 1, "outside")[0]


def test_gradients_left_under_no_sync_are_an_error() -> None:
    assert "never reduced" in run_distributed(misuse, 1, "no_sync")[0]


def bucket_sizes() -> list[int]:
    return [len(b.params) for b in ZeroOptimizer(two_chunks(), torch.optim.AdamW).buckets]


def test_buckets_never_span_chunks() -> None:
    assert run_distributed(bucket_sizes, 1)[0] == [6, 6]  # 2**24-element default buckets: one per chunk


def test_buckets_come_in_the_order_they_complete() -> None:
    """A part spread over the model (here the 1-d parameters of a no-decay group) goes after
    the buckets that complete before its last parameter arrives."""
    params = [nn.Parameter(torch.zeros(n)) for n in (4, 1, 4, 1, 4)]  # arrival order in backward
    buckets = assign_buckets(params, key=lambda p: p.numel() == 1, bucket_numel=4)
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in b] for b in buckets] == [[0], [2], [1, 3], [4]]


def test_the_buckets_completed_last_are_small() -> None:
    """Their reductions have little or no backward left to hide behind: the packing starts
    from the last gradient to arrive, with a bucket of at most last_numel elements, and the
    caps double from there up to bucket_numel; a bucket closes only once half full, and a
    leftover under half its cap joins its neighbour."""
    params = [nn.Parameter(torch.zeros(1)) for _ in range(16)]  # arrival order in backward
    index = {id(p): i for i, p in enumerate(params)}

    def layout(**sizes: int) -> list[list[int]]:
        return [[index[id(p)] for p in b] for b in assign_buckets(params, key=lambda p: 0, **sizes)]

    assert layout(bucket_numel=8) == [list(range(8)), list(range(8, 16))]
    assert layout(bucket_numel=4, last_numel=1) == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14], [15]]
    assert layout(bucket_numel=8, last_numel=0) == [list(range(9)), [9, 10, 11, 12], [13, 14], [15]]  # caps from 1
    assert layout(bucket_numel=4, last_numel=9) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [len(b) for b in layout(bucket_numel=16, last_numel=3)] == [7, 6, 3]
    del params[7:]  # caps 2, 4 from the end leave 1 parameter over: it joins the 4
    assert layout(bucket_numel=4, last_numel=2) == [[0, 1, 2, 3, 4], [5, 6]]
    sliver = [nn.Parameter(torch.zeros(n)) for n in (6, 1)]  # a 1-element bucket under a cap of 4 takes the 6
    assert [len(b) for b in assign_buckets(sliver, key=lambda p: 0, bucket_numel=8, last_numel=4)] == [2]
    assert Communication().last_bucket == Communication().bucket_numel // 16
    assert Communication(last_bucket_numel=5).last_bucket == 5
