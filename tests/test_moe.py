"""The Mixture-of-Experts layer (research/moe.py) and expert parallelism (parallel/expert/):
the grouped GEMM against a loop, dispatch then combine as the identity, the layer against a
token-by-token reference, and every (tp, sp, ep) layout against one process: outputs, the
auxiliary losses and the gradients of router and experts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel import ParallelDims, accounting
from parallel.expert import TokenDispatcher, grouped_mm
from research.moe import MoE, MoEConfig
from tests.conftest import slow_except
from tests.dist_utils import run_distributed

CFG = MoEConfig(d_model=16, experts=4, top_k=2, d_ff=24, swiglu=False, aux_loss_coeff=0.01, z_loss_coeff=0.001)


# ---- grouped GEMM --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rows, inner, outer, counts",
    [(13, 8, 16, [3, 0, 10]), (7, 6, 5, [2, 5, 0]), (0, 8, 16, [0, 0, 0]), (9, 16, 8, [0, 9, 0])],
)
def test_grouped_mm_is_a_matmul_per_expert(rows: int, inner: int, outer: int, counts: list[int]) -> None:
    """Aligned shapes take torch._grouped_mm, the others a loop; both equal x_e · W_e."""
    x = torch.randn(rows, inner, requires_grad=True)
    w = torch.randn(len(counts), inner, outer, requires_grad=True)
    g = torch.randn(rows, outer)
    grouped_mm(x, w, counts).backward(g)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([xe @ wr[e] for e, xe in enumerate(torch.split(xr, counts))])
    ref.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-6, atol=1e-6)


def test_grouped_mm_refuses_counts_that_do_not_split_the_rows() -> None:
    with pytest.raises(ValueError, match="do not split 5 rows over 2 experts"):
        grouped_mm(torch.randn(5, 4), torch.randn(2, 4, 4), [2, 2])


# ---- dispatch and combine ------------------------------------------------------------------
def _round_trip(tokens: int, experts: int, k: int, capacity: float | None, ep_group, seed: int) -> dict:
    """Dispatch this rank's tokens, mark each arriving row with its local expert, combine:
    every kept slot must come back as its token (times nothing), dropped ones as zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 8, generator=g, requires_grad=True)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    chosen[: tokens // 2, 0] = 0  # a skewed load: expert 0 gets most
    d = TokenDispatcher(experts, ep_group, capacity)
    rows, counts, plan = d.dispatch(x, chosen)
    local = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64))
    first = d.ep_rank * d.local_experts
    back = d.combine(rows, plan).view(tokens, k, 8)
    expert_of_row = d.combine(local.float().unsqueeze(1).expand(-1, 8) + first, plan).view(tokens, k, 8)
    grad = torch.randn(tokens, k, 8, generator=g)
    back.backward(grad)
    return {
        "x": x.detach(),
        "chosen": chosen,
        "back": back.detach(),
        "expert_of_row": expert_of_row[..., 0],
        "x_grad": x.grad,
        "grad": grad,
        "dropped": d.dropped,
        "capacity": d.slots_per_expert,
    }


def _check_round_trip(r: dict, experts: int) -> None:
    kept = r["back"].abs().sum(-1) > 0
    if r["capacity"] is None:
        assert kept.all() and r["dropped"] == 0
    else:  # each expert keeps its first `capacity` slots in token order
        seen = torch.zeros(experts, dtype=torch.int64)
        for t, j in torch.cartesian_prod(torch.arange(r["chosen"].shape[0]), torch.arange(r["chosen"].shape[1])):
            e = r["chosen"][t, j]
            assert bool(kept[t, j]) == bool(seen[e] < r["capacity"]), (t, j)
            seen[e] += 1
        assert r["dropped"] == int((~kept).sum())
    assert torch.equal(r["back"][kept], r["x"].unsqueeze(1).expand_as(r["back"])[kept])
    assert torch.equal(r["expert_of_row"][kept], r["chosen"][kept].float())  # each slot reached its expert
    torch.testing.assert_close(r["x_grad"], (r["grad"] * kept.unsqueeze(-1)).sum(1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_dispatch_then_combine_is_the_identity_on_one_rank(capacity: float | None) -> None:
    _check_round_trip(_round_trip(10, 4, 2, capacity, None, seed=0), 4)


def _round_trip_on_every_rank(experts: int, capacity: float | None) -> dict:
    rank = dist.get_rank()
    return _round_trip(6 + 3 * rank, experts, 2, capacity, dist.group.WORLD, seed=rank)


@pytest.mark.parametrize("ep", slow_except([2], [4]))
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_dispatch_then_combine_is_the_identity_across_ranks(ep: int, capacity: float | None) -> None:
    """Ranks with different token counts, a skewed load (some experts get no token from a
    rank): every slot reaches its expert's rank and comes back, values and gradients."""
    for r in run_distributed(_round_trip_on_every_rank, ep, 2 * ep, capacity):
        _check_round_trip(r, 2 * ep)


def _three_experts_over_the_world() -> str:
    try:
        TokenDispatcher(3, dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


def test_experts_must_split_over_ep() -> None:
    for message in run_distributed(_three_experts_over_the_world, 2):
        assert "3 experts cannot be split over ep=2 ranks" in message


# ---- the layer against a token-by-token reference -------------------------------------------
def reference_moe(layer: MoE, x_sbh: torch.Tensor) -> torch.Tensor:
    """y_t = Σ_j w_tj · MLP_{e_tj}(x_t), one token at a time (dropless, one rank, tp = 1)."""
    cfg = layer.cfg
    x = x_sbh.reshape(-1, cfg.d_model)
    probs = F.linear(x, layer.router.weight).softmax(-1)
    w, chosen = probs.topk(cfg.top_k, -1)
    if cfg.renormalize:
        w = w / w.sum(-1, keepdim=True)
    out = []
    for t in range(x.shape[0]):
        y = 0
        for j in range(cfg.top_k):
            e = chosen[t, j]
            u = x[t] @ layer.experts.up[e].flatten(1)
            a = F.silu(u.chunk(2)[0]) * u.chunk(2)[1] if cfg.swiglu else F.gelu(u)
            y = y + w[t, j] * (a @ layer.experts.down[e])
        out.append(y)
    return torch.stack(out).view(x_sbh.shape)


@pytest.mark.parametrize(
    "overrides", [{}, {"swiglu": True}, {"top_k": 1, "renormalize": False}, {"top_k": 3, "renormalize": False}]
)
def test_the_layer_is_the_weighted_sum_of_its_top_k_experts(overrides: dict) -> None:
    torch.manual_seed(0)
    layer = MoE(dataclasses.replace(CFG, **overrides))
    x = torch.randn(5, 3, CFG.d_model)
    y, _ = layer(x)
    torch.testing.assert_close(y, reference_moe(layer, x), rtol=1e-5, atol=1e-6)


def test_auxiliary_losses_are_switch_and_z_loss() -> None:
    torch.manual_seed(0)
    layer = MoE(CFG)
    x = torch.randn(5, 3, CFG.d_model)
    _, aux = layer(x)
    logits = F.linear(x.reshape(-1, CFG.d_model), layer.router.weight)
    probs = logits.softmax(-1)
    chosen = probs.topk(CFG.top_k, -1).indices
    f = torch.bincount(chosen.reshape(-1), minlength=CFG.experts).float() / (15 * CFG.top_k)
    switch = CFG.aux_loss_coeff * CFG.experts * (f * probs.mean(0)).sum()
    z = CFG.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(aux, switch + z)
    stats = layer.take_stats()
    assert stats.aux_loss == pytest.approx(switch.item()) and stats.z_loss == pytest.approx(z.item())
    assert stats.tokens_per_expert.sum() == 15 * CFG.top_k and stats.micro_batches == 1


def test_capacity_drops_the_overflow_and_counts_it() -> None:
    torch.manual_seed(0)
    layer = MoE(dataclasses.replace(CFG, capacity_factor=0.5))
    layer(torch.randn(8, 2, CFG.d_model))
    stats = layer.take_stats()
    c = layer.dispatcher.slots_per_expert
    assert c == 4 and stats.slots == 32
    assert stats.dropped == int((stats.tokens_per_expert - c).clamp(min=0).sum())


# ---- every layout against one process ----------------------------------------------------------
WORLD = 4
SEQ, BATCH = 4, 2  # per data-parallel rank


def layout_groups(tp: int, ep: int) -> tuple:
    """`ParallelDims(tp, dp=4/tp, ep)` over the 4 ranks: (tp group, its expert groups, dp rank)."""
    dims = ParallelDims(tp=tp, ep=ep).build()
    return dims.tp_group, dims.expert_groups, dims.dp_rank


def inputs(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens [SEQ, dp·BATCH, h] of all dp ranks and a fixed output gradient."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(SEQ, dp * BATCH, CFG.d_model, generator=g), torch.randn(
        SEQ, dp * BATCH, CFG.d_model, generator=g
    )


def one_process(cfg: MoEConfig, dp: int) -> dict:
    torch.manual_seed(0)
    layer = MoE(cfg)
    x, g = inputs(dp)
    x.requires_grad_()
    y, aux = layer(x)
    ((y * g).mean() + aux).backward()
    return {
        "y": y.detach(),
        "aux": aux.item(),
        "router": layer.router.weight.grad,
        "up": layer.experts.up.grad,
        "down": layer.experts.down.grad,
        "x": x.grad,
    }


def one_layout(cfg: MoEConfig, tp: int, ep: int, sp: bool) -> dict:
    """This rank's slice of the tokens through the layer; the gradients reduced as the
    optimizer will: dense ones averaged over dp, expert ones summed over the ranks holding
    the same experts and divided by dp."""
    tp_group, groups, d = layout_groups(tp, ep)
    dp_group, ep_group = groups.dp, groups.ep
    dp = WORLD // tp
    torch.manual_seed(0)
    layer = MoE(cfg, tp_group, sp, groups)
    x_all, g_all = inputs(dp)
    mine = slice(d * BATCH, (d + 1) * BATCH)
    x, g = x_all[:, mine].clone(), g_all[:, mine]
    if sp:  # this TP rank's sequence shard
        t = dist.get_rank(tp_group)
        x, g = x.chunk(tp)[t].clone(), g.chunk(tp)[t]
    x.requires_grad_()
    y, aux = layer(x)
    # the mean over this rank's output elements, as the dp-mean of per-rank means gives the global one
    ((y * g).sum() / (SEQ * BATCH * CFG.d_model) + aux).backward()
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router, group=dp_group)
    experts = {}
    for name in ("up", "down"):
        grad = getattr(layer.experts, name).grad.clone()
        edp = [r for r in range(WORLD) if r % tp == dist.get_rank() % tp]  # same tp slice and same experts
        edp = [r for r in edp if (r // tp) % ep == d % ep]
        total = torch.zeros_like(grad)
        for r in range(WORLD):  # sum over the expert-data-parallel ranks, by broadcasts
            part = grad.clone()
            dist.broadcast(part, r)
            total += part if r in edp else 0
        experts[name] = total / dp
    return {
        "y": y.detach(),
        "aux": aux.item(),
        "router": router / dp,
        **experts,
        "x": x.grad,
        "d": d,
        "tp_rank": dist.get_rank(tp_group),
        "ep_rank": dist.get_rank(ep_group) if ep_group is not None else 0,
    }


LAYOUTS = [(1, 4, False), (1, 2, False), (2, 2, False), (2, 2, True), (2, 1, True), (4, 1, True)]


@pytest.mark.parametrize("tp, ep, sp", slow_except(LAYOUTS[:4], LAYOUTS[4:]))
@pytest.mark.parametrize("capacity", [None])
def test_every_layout_equals_one_process(tp: int, ep: int, sp: bool, capacity: float | None) -> None:
    """Outputs, the auxiliary losses, and the gradients of router, experts and input."""
    cfg = dataclasses.replace(CFG, capacity_factor=capacity)
    dp = WORLD // tp
    ref = one_process(cfg, dp)
    for r in run_distributed(one_layout, WORLD, cfg, tp, ep, sp, timeout=180):
        mine = slice(r["d"] * BATCH, (r["d"] + 1) * BATCH)
        y_ref, x_ref = ref["y"][:, mine], ref["x"][:, mine] * dp
        if sp:
            y_ref, x_ref = y_ref.chunk(tp)[r["tp_rank"]], x_ref.chunk(tp)[r["tp_rank"]]
        torch.testing.assert_close(r["y"], y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["x"], x_ref, rtol=1e-5, atol=1e-6)
        assert r["aux"] == pytest.approx(ref["aux"], rel=1e-6)
        torch.testing.assert_close(r["router"], ref["router"], rtol=1e-5, atol=1e-7)
        experts = slice(r["ep_rank"] * CFG.experts // ep, (r["ep_rank"] + 1) * CFG.experts // ep)
        for name, dim in (("up", 3), ("down", 1)):
            full = ref[name][experts].chunk(tp, dim)[r["tp_rank"]]
            torch.testing.assert_close(r[name], full, rtol=1e-5, atol=1e-7)


# ---- what the exchange costs, and ranks without tokens ---------------------------------------
def _bytes_of_a_layer(capacity: float | None) -> dict:
    """All-to-all bytes of one forward + backward of the layer at ep = world, and the rows
    this rank sends to and receives from the other ranks, from the routing recomputed here."""
    from parallel import comm

    dims = ParallelDims(ep=dist.get_world_size()).build()
    cfg = dataclasses.replace(CFG, capacity_factor=capacity)
    torch.manual_seed(0)
    layer = MoE(cfg, dims.tp_group, False, dims.expert_groups)
    x = torch.randn(SEQ, BATCH, CFG.d_model, generator=torch.Generator().manual_seed(dist.get_rank()))
    x.requires_grad_()  # as inside a model: the dispatch's backward sends the input gradients back
    with accounting.tracking() as log:
        y, aux = layer(x)
        (y.sum() + aux).backward()
    chosen = F.linear(x.detach().reshape(-1, CFG.d_model), layer.router.weight).topk(CFG.top_k, -1).indices
    per_rank = torch.bincount(chosen.reshape(-1) // (CFG.experts // dims.ep), minlength=dims.ep)
    everyone = comm.all_gather_object(per_rank.tolist())
    me = dims.dp_rank
    return {
        "bytes": log.as_dict()["ep"]["all_to_all_single"]["bytes"],
        "out": sum(per_rank.tolist()) - per_rank[me].item(),
        "in": sum(r[me] for j, r in enumerate(everyone) if j != me),
        "ep": dims.ep,
        "capacity": layer.dispatcher.slots_per_expert,
    }


@pytest.mark.parametrize("ep", slow_except([2], [4]))
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_all_to_all_bytes_are_the_rows_that_leave_each_rank(capacity: float | None, ep: int) -> None:
    """Dropless: the expert counts (E int64 in equal parts), then each row this rank sends
    out and each it sends back, twice (forward and backward): E·8·(ep−1)/ep + 2·4h·(out + in).
    With a capacity C: 4 exchanges of exactly E·C·(ep−1)/ep rows of 4h bytes."""
    h, e = CFG.d_model, CFG.experts
    for r in run_distributed(_bytes_of_a_layer, ep, capacity):
        if capacity is None:
            assert r["bytes"] == e * 8 * (ep - 1) // ep + 2 * 4 * h * (r["out"] + r["in"])
        else:
            assert r["bytes"] == 4 * 4 * h * e * r["capacity"] * (ep - 1) // ep


def _a_rank_without_tokens() -> dict:
    """Positive inputs and a router that always prefers experts 0 and 1: ep rank 1 (experts 2
    and 3) receives no token, forward and backward run, its experts' gradients are zero."""
    dims = ParallelDims(ep=2).build()
    torch.manual_seed(0)
    layer = MoE(CFG, dims.tp_group, False, dims.expert_groups)
    with torch.no_grad():
        layer.router.weight[:2] = 1.0
        layer.router.weight[2:] = -1.0
    x = torch.rand(SEQ, BATCH, CFG.d_model, generator=torch.Generator().manual_seed(dist.get_rank()))
    y, aux = layer(x)
    (y.sum() + aux).backward()
    return {"rank": dims.dp_rank, "y": y.detach(), "up": layer.experts.up.grad, "x": x}


def test_a_rank_whose_experts_get_no_token_runs_and_stays_exact() -> None:
    results = run_distributed(_a_rank_without_tokens, 2)
    torch.manual_seed(0)
    single = MoE(CFG)
    with torch.no_grad():
        single.router.weight[:2] = 1.0
        single.router.weight[2:] = -1.0
    for r in results:
        torch.testing.assert_close(r["y"], single(r["x"])[0].detach(), rtol=1e-5, atol=1e-6)
    assert results[1]["up"].abs().sum() == 0 and results[0]["up"].abs().sum() > 0
