"""parallel/tensor: TP / SP mappings, parallel layers, vocab-parallel cross entropy, init.

Every check runs on gloo ranks against an unsharded reference that each rank builds
from the same seed (F.linear with the full weight, F.embedding, F.cross_entropy), fp32,
rtol 1e-5 / atol 1e-6. One distributed run per (world, tp) does all the checks
(`_suite`, cached); the test functions assert on what the ranks return. (4, 2) has two
TP groups, so a layer that confused global and group rank would fail there.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel import accounting
from parallel.marks import param_marks
from parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
    sequence_parallel_grad_sync,
    tp_rank,
    tp_size,
    vocab_parallel_cross_entropy,
)
from tests.dist_utils import run_distributed

S, B, H = 8, 2, 8  # x_sbh; S and H divisible by every tp used
LAYOUTS = [(1, 1), (2, 2), (4, 4), (4, 2)]  # (world, tp)
AR, AG, RS = "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"


def _rand(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _ops(log: accounting.CommLog) -> dict[str, int]:
    return {op: e["calls"] for op, e in log.as_dict().get("tp", {}).items()}


def _chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.chunk(tp_size(group), dim=dim)[tp_rank(group)]


# ---------------------------------------------------------------------------
# Per-rank checks
# ---------------------------------------------------------------------------


def _check_mappings(group) -> dict[str, tuple[dict, dict]]:
    """Forward and backward of each mapping against its definition; returns the
    collectives of one forward and of one backward per mapping."""
    tp = tp_size(group)
    full, last, first = (S, B, H), (S, B, H // tp), (S // tp, B, H)

    def per(shape, seed):  # the tensor of group rank q, for every q
        return [_rand(shape, seed + 100 * q) for q in range(tp)]

    def ssum(ts):
        return torch.stack(ts).sum(0)

    r = tp_rank(group)
    # name: (fn, inputs per rank, grads per rank, expected y, expected dx)
    xs_full, xs_last, xs_first = per(full, 1), per(last, 2), per(first, 3)
    ds_full, ds_last, ds_first = per(full, 4), per(last, 5), per(first, 6)
    same = [xs_full[0]] * tp  # a replicated input
    cases = {
        "copy_to_tp": (copy_to_tp, xs_full, ds_full, xs_full[r], ssum(ds_full)),
        "reduce_from_tp": (reduce_from_tp, xs_full, ds_full, ssum(xs_full), ds_full[r]),
        "scatter_to_tp": (scatter_to_tp, same, ds_last, _chunk(same[0], -1, group), torch.cat(ds_last, -1)),
        "gather_from_tp": (gather_from_tp, xs_last, ds_full, torch.cat(xs_last, -1), _chunk(ds_full[r], -1, group)),
        "scatter_to_sp": (scatter_to_sp, same, ds_first, _chunk(same[0], 0, group), torch.cat(ds_first, 0)),
        "gather_from_sp": (gather_from_sp, xs_first, ds_full, torch.cat(xs_first, 0), _chunk(ssum(ds_full), 0, group)),
        "reduce_scatter_to_sp": (
            reduce_scatter_to_sp,
            xs_full,
            ds_first,
            _chunk(ssum(xs_full), 0, group),
            torch.cat(ds_first, 0),
        ),
    }
    counts = {}
    for name, (fn, xs, ds, y_expected, dx_expected) in cases.items():
        x = xs[r].clone().requires_grad_()
        dy = ds[r].clone()
        with accounting.tracking() as fwd:
            y = fn(x, group)
        _close(y, y_expected, f"{name} forward")
        with accounting.tracking() as bwd:
            y.backward(dy)
        _close(x.grad, dx_expected, f"{name} backward")
        assert torch.equal(x.detach(), xs[r]) and torch.equal(dy, ds[r]), f"{name} wrote its input"
        counts[name] = (_ops(fwd), _ops(bwd))
    if tp > 1:
        with pytest.raises(ValueError, match="not divisible by tp"):
            scatter_to_tp(torch.zeros(S, B, H + 1), group)
    return counts


def _linear_case(layer_cls, kwargs: dict, group, n_in: int, n_out: int, seed: int) -> None:
    """One Column/RowParallelLinear config, two accumulated backward passes, vs F.linear."""
    sp = kwargs["sequence_parallel"]
    column = layer_cls is ColumnParallelLinear
    torch.manual_seed(seed)
    w_ref = torch.empty(n_out, n_in).normal_(0.0, 0.02).requires_grad_()
    b_ref = _rand(n_out, seed).requires_grad_()
    torch.manual_seed(seed)
    layer = layer_cls(n_in, n_out, group=group, **kwargs)
    assert torch.equal(layer.weight, _chunk(w_ref, 0 if column else 1, group).detach()), "init"
    layer.bias.data.copy_(_chunk(b_ref, 0, group) if column else b_ref)

    for step in range(2):
        x_ref = _rand((S, B, n_in), seed + 10 + step).requires_grad_()
        dy_ref = _rand((S, B, n_out), seed + 20 + step)
        y_ref = F.linear(x_ref, w_ref, b_ref)
        y_ref.backward(dy_ref)
        # the layer's input / output layout
        if column:
            x = _chunk(x_ref, 0, group) if sp else x_ref
            keep_y = (lambda t: t) if kwargs["gather_output"] else (lambda t: _chunk(t, -1, group))
        else:
            x = _chunk(x_ref, -1, group) if kwargs["input_is_parallel"] else x_ref
            keep_y = (lambda t: _chunk(t, 0, group)) if sp else (lambda t: t)
        x = x.detach().clone().requires_grad_()
        y = layer(x)
        _close(y, keep_y(y_ref), f"{layer!r} step {step} output")
        y.backward(keep_y(dy_ref))
        if column:
            dx_ref = _chunk(x_ref.grad, 0, group) if sp else x_ref.grad
        else:
            dx_ref = _chunk(x_ref.grad, -1, group) if kwargs["input_is_parallel"] else x_ref.grad
        _close(x.grad, dx_ref, f"{layer!r} step {step} input grad")
    # weight / bias grads accumulated over both steps (a bias SP-synced per backward)
    _close(layer.weight.grad, _chunk(w_ref.grad, 0 if column else 1, group), f"{layer!r} weight grad")
    _close(layer.bias.grad, _chunk(b_ref.grad, 0, group) if column else b_ref.grad, f"{layer!r} bias grad")
    if not column:
        assert any(g is group for g in param_marks(layer)[layer.bias].replicated), "row bias not marked"


def _check_layers(group) -> dict:
    """Every layer config against its reference; init error messages; MLP collectives."""
    for sp, gather_output in itertools.product([False, True], repeat=2):
        _linear_case(
            ColumnParallelLinear, {"sequence_parallel": sp, "gather_output": gather_output}, group, H, 2 * H, seed=11
        )
    for sp, input_is_parallel in itertools.product([False, True], repeat=2):
        _linear_case(
            RowParallelLinear,
            {"sequence_parallel": sp, "input_is_parallel": input_is_parallel},
            group,
            2 * H,
            H,
            seed=12,
        )

    for sp in (False, True):
        torch.manual_seed(13)
        e_ref = torch.empty(16, H).normal_(0.0, 0.02).requires_grad_()
        torch.manual_seed(13)
        emb = VocabParallelEmbedding(16, H, group=group, sequence_parallel=sp)
        ids = torch.randint(0, 16, (S, B), generator=torch.Generator().manual_seed(14))
        ids[0, 0], ids[-1, -1] = 0, 15
        dy_ref = _rand((S, B, H), 15)
        y_ref = F.embedding(ids, e_ref)
        y_ref.backward(dy_ref)
        keep = (lambda t: _chunk(t, 0, group)) if sp else (lambda t: t)
        y = emb(ids)
        _close(y, keep(y_ref), f"embedding sp={sp} output")
        y.backward(keep(dy_ref))
        _close(emb.weight.grad, _chunk(e_ref.grad, 0, group), f"embedding sp={sp} weight grad")

    tp = tp_size(group)
    if tp > 1:
        for make, msg in [
            (lambda: ColumnParallelLinear(8, 4 * tp + 1, group=group), f"out_features={4 * tp + 1} "),
            (lambda: RowParallelLinear(4 * tp + 1, 8, group=group), f"in_features={4 * tp + 1} "),
            (lambda: VocabParallelEmbedding(4 * tp + 1, 8, group=group), f"num_embeddings={4 * tp + 1} "),
        ]:
            with pytest.raises(ValueError, match=msg + f"is not divisible by tp={tp}"):
                make()

    # Collectives of a Column -> Row block, per forward and per backward.
    counts = {}
    for sp in (False, True):
        fc1 = ColumnParallelLinear(H, 2 * H, group=group, sequence_parallel=sp)
        fc2 = RowParallelLinear(2 * H, H, group=group, sequence_parallel=sp)
        x = _rand((S // tp if sp else S, B, H), 16).requires_grad_()
        with accounting.tracking() as fwd:
            y = fc2(F.gelu(fc1(x)))
        with accounting.tracking() as bwd:
            y.sum().backward()
        counts[sp] = (_ops(fwd), _ops(bwd))

    # A deep copy shares the group and keeps the SP row bias marked and synced.
    clone = copy.deepcopy(fc2)
    assert clone.group is group and any(g is group for g in param_marks(clone)[clone.bias].replicated)
    clone(_rand((S, B, 2 * H // tp), 24)).sum().backward()
    _close(clone.bias.grad, torch.full((H,), float(S * B)), "deep-copied SP row bias grad")
    return counts


def _check_sp_grad_sync(group) -> dict[str, int]:
    """A LayerNorm-like weight on SP shards: the hook sums the grad over TP before any
    post-accumulate hook (registered earlier) sees it, and once per backward."""
    owner = nn.Module()
    owner.weight = p = nn.Parameter(torch.ones(H))
    seen = []
    p.register_post_accumulate_grad_hook(lambda q: seen.append(q.grad.clone()))
    sequence_parallel_grad_sync(owner, "weight", group)
    sequence_parallel_grad_sync(owner, "weight", group)  # idempotent
    assert any(g is group for g in param_marks(owner)[p].replicated)
    xs = [_rand((S, B, H), 17), _rand((S, B, H), 18)]
    with accounting.tracking() as log:
        for x in xs:
            (_chunk(x, 0, group) * p).sum().backward()
    full = [x.sum((0, 1)) for x in xs]
    _close(seen[0], full[0], "grad seen by a post-accumulate hook")
    _close(p.grad, full[0] + full[1], "accumulated grad")
    return _ops(log)


def _check_cross_entropy(group) -> dict:
    """vs F.cross_entropy of the gathered logits, with and without vocabulary padding."""
    counts = {}
    for v_pad, vocab in [(64, 61), (16, 10), (16, None)]:
        n = v_pad if vocab is None else vocab
        logits_full = 3 * _rand((S, B, v_pad), 19)
        logits_full[..., n:] = 50.0  # padding columns must not count
        targets = torch.randint(0, n, (S, B), generator=torch.Generator().manual_seed(20))
        dloss = _rand((S, B), 21)
        ref = logits_full.clone().requires_grad_()
        loss_ref = F.cross_entropy(ref[..., :n].reshape(-1, n), targets.reshape(-1), reduction="none")
        loss_ref.view(S, B).backward(dloss)

        local = _chunk(logits_full, -1, group).clone().requires_grad_()
        with accounting.tracking() as fwd:
            loss = vocab_parallel_cross_entropy(local, targets, group, vocab_size=vocab)
        with accounting.tracking() as bwd:
            loss.backward(dloss)
        assert loss.dtype == torch.float32 and loss.shape == (S, B)
        _close(loss, loss_ref.view(S, B), f"loss v={v_pad} vocab={vocab}")
        _close(local.grad, _chunk(ref.grad, -1, group), f"grad v={v_pad} vocab={vocab}")
        assert torch.equal(local.detach(), _chunk(logits_full, -1, group)), "logits modified"
        payload = fwd.as_dict().get("tp", {}).get(AR, {}).get("payload_bytes", 0)
        counts[(v_pad, vocab)] = (_ops(fwd), _ops(bwd), payload)

    # bf16 logits: fp32 loss, bf16 gradient
    local = _chunk(3 * _rand((S, B, 16), 22), -1, group).bfloat16().requires_grad_()
    targets = torch.randint(0, 16, (S, B), generator=torch.Generator().manual_seed(23))
    loss = vocab_parallel_cross_entropy(local, targets, group)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and local.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="vocab_size=17"):
        vocab_parallel_cross_entropy(local, targets, group, vocab_size=17)
    return counts


def _init_shards(group) -> list[torch.Tensor]:
    torch.manual_seed(1234)
    col = ColumnParallelLinear(H, 2 * H, group=group)
    row = RowParallelLinear(2 * H, H, group=group, init_method=lambda w: nn.init.uniform_(w, -1, 1))
    emb = VocabParallelEmbedding(16, H, group=group)
    assert not col.bias.any() and not row.bias.any()
    return [col.weight.detach(), row.weight.detach(), emb.weight.detach()]


def _suite(tp: int) -> dict:
    """Everything, on one rank; TP groups are consecutive ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world, tp)]
    group = groups[rank // tp]
    accounting.set_group_name(group, "tp")
    return {
        "mappings": _check_mappings(group),
        "layers": _check_layers(group),
        "sp_grad_sync": _check_sp_grad_sync(group),
        "cross_entropy": _check_cross_entropy(group),
        "shards": _init_shards(group),
    }


@functools.cache
def _results(world: int, tp: int) -> list[dict]:
    return run_distributed(_suite, world, tp, timeout=90)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

layouts = pytest.mark.parametrize("world,tp", LAYOUTS, ids=[f"world{w}-tp{t}" for w, t in LAYOUTS])


@layouts
def test_mappings(world, tp):
    expected = {  # (forward, backward) collectives on the TP group
        "copy_to_tp": ({}, {AR: 1}),
        "reduce_from_tp": ({AR: 1}, {}),
        "scatter_to_tp": ({}, {AG: 1}),
        "gather_from_tp": ({AG: 1}, {}),
        "scatter_to_sp": ({}, {AG: 1}),
        "gather_from_sp": ({AG: 1}, {RS: 1}),
        "reduce_scatter_to_sp": ({RS: 1}, {AG: 1}),
    }
    if tp == 1:  # identities, no collective
        expected = {name: ({}, {}) for name in expected}
    for result in _results(world, tp):
        assert result["mappings"] == expected


@layouts
def test_layers(world, tp):
    """Outputs and gradients are checked on the ranks; here: an MLP block's collectives
    (Korthikanti et al.: without SP one all-reduce each way; with SP all-gather +
    reduce-scatter each way, plus the row bias's SP grad all-reduce in backward, and the
    column input's all-gather again in backward: it keeps only its shard for dW)."""
    expected = {False: ({AR: 1}, {AR: 1}), True: ({AG: 1, RS: 1}, {AG: 2, RS: 1, AR: 1})}
    if tp == 1:
        expected = {False: ({}, {}), True: ({}, {})}
    for result in _results(world, tp):
        assert result["layers"] == expected


@layouts
def test_sequence_parallel_grad_sync(world, tp):
    for result in _results(world, tp):
        assert result["sp_grad_sync"] == ({AR: 2} if tp > 1 else {})


@layouts
def test_vocab_parallel_cross_entropy(world, tp):
    for result in _results(world, tp):
        for (v_pad, vocab), (fwd, bwd, payload) in result["cross_entropy"].items():
            assert fwd == ({AR: 3} if tp > 1 else {}), (v_pad, vocab)
            assert bwd == {}
            assert payload == (3 * S * B * 4 if tp > 1 else 0)  # three fp32 [s, b] tensors


@layouts
def test_init_is_independent_of_tp(world, tp):
    """Concatenating the shards of the TP ranks gives the tp=1 weights (built here,
    without a process group)."""
    with torch.random.fork_rng():
        full = _init_shards(None)
    results = _results(world, tp)
    for g in range(world // tp):
        ranks = results[g * tp : (g + 1) * tp]
        for i, dim in enumerate([0, 1, 0]):
            assert torch.equal(torch.cat([r["shards"][i] for r in ranks], dim), full[i])


def test_without_process_group():
    """tp = 1 needs no torch.distributed: group=None before init_process_group is size 1."""
    assert not dist.is_initialized()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        emb = VocabParallelEmbedding(16, H, group=None)
        fc1 = ColumnParallelLinear(H, 2 * H, group=None, gather_output=True)
        fc2 = RowParallelLinear(2 * H, 16, group=None, sequence_parallel=True)
    ids = torch.randint(0, 16, (S, B), generator=torch.Generator().manual_seed(0))
    logits = fc2(fc1(emb(ids)))
    ref = F.linear(F.linear(F.embedding(ids, emb.weight), fc1.weight, fc1.bias), fc2.weight, fc2.bias)
    _close(logits, ref, "logits")
    loss = vocab_parallel_cross_entropy(logits, ids, None)
    _close(loss, F.cross_entropy(ref.reshape(-1, 16), ids.reshape(-1), reduction="none").view(S, B), "loss")
