"""ZeroOptimizer semantics beyond the parity matrix: no_sync accumulation, changing module
order, other inner optimizers and step backends, fp16 loss scaling, and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optim import DynamicLossScaler, ZeroOptimizer
from optim.policies import POLICY_CLASSES, Communication, MixedPrecision
from tests.conftest import slow_except
from tests.dist_utils import run_distributed
from tests.models import TinyLM, batches, make_model, micro_slices, reference_run
from tests.test_zero_parity import BATCH, LR, MICRO, STEPS, assert_matches, reference
from tests.zero_runs import zero_train

SMALL = {"communication": Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_sync_accumulation_matches(stage: int) -> None:
    out = run_distributed(zero_train, 2, stage, STEPS, BATCH, MICRO, lr=LR, use_no_sync=True, zero_kwargs=SMALL)
    assert_matches(out[0], reference(2))


def unreduced_step() -> str:
    model = make_model()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2)
    idx = torch.zeros(2, 4, dtype=torch.long)
    with opt.no_sync():
        opt.backward(model(idx, idx))
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_step_after_no_sync_only_is_an_error() -> None:
    assert all("never reduced" in msg for msg in run_distributed(unreduced_step, 2))


def alternate_block_order(model: TinyLM, step: int) -> None:
    model.reverse_blocks = step % 2 == 1


@pytest.mark.parametrize("stage", slow_except([3], [2]))
def test_module_order_changing_between_steps(stage: int) -> None:
    out = run_distributed(
        zero_train, 2, stage, STEPS, BATCH, MICRO, lr=LR, zero_kwargs=SMALL, before_step=alternate_block_order
    )
    ref = reference_run(STEPS, BATCH, MICRO, 2, torch.optim.AdamW, lr=LR, before_step=alternate_block_order)
    assert_matches(out[0], ref)


@pytest.mark.parametrize("optimizer,kwargs", slow_except([("SGD", {"momentum": 0.9}), ("Adagrad", {})], [("Adam", {})]))
@pytest.mark.parametrize("stage", slow_except([3], [1]))
def test_other_elementwise_optimizers(optimizer: str, kwargs: dict, stage: int) -> None:
    cls = getattr(torch.optim, optimizer)
    out = run_distributed(
        zero_train, 2, stage, STEPS, BATCH, MICRO, optimizer_class=cls, lr=LR, zero_kwargs=SMALL, **kwargs
    )
    assert_matches(out[0], reference_run(STEPS, BATCH, MICRO, 2, cls, lr=LR, **kwargs))


@pytest.mark.parametrize("backend", ["torch", "torch_fused"])
def test_step_backends_agree(backend: str) -> None:
    out = run_distributed(zero_train, 2, 2, STEPS, BATCH, MICRO, lr=LR, zero_kwargs={**SMALL, "step_backend": backend})
    assert_matches(out[0], reference(2))


def fp16_overflow_on_one_rank() -> dict:
    """Rank 1 alone sees an inf gradient on the second step: every rank must skip it."""
    model = make_model()
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=2,
        precision=MixedPrecision(torch.float16, loss_scaler=DynamicLossScaler(hysteresis=1)),
        lr=LR,
        **SMALL,
    )
    idx = torch.randint(0, 37, (4, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    scales, changed = [], []
    for step in range(3):
        before = opt.full_state_dict()["blocks.0.fc1.weight"]
        loss = model(idx, idx)
        if step == 1 and dist.get_rank() == 1:
            loss = loss * float("inf")
        opt.backward(loss)
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        scales.append(opt.scaler.scale)
        changed.append(not torch.equal(before, opt.full_state_dict()["blocks.0.fc1.weight"]))
        if step == 1:
            changed.append(bool(torch.isfinite(norm)))
    return {"scales": scales, "changed": changed}


def test_fp16_overflow_on_one_rank_skips_everywhere() -> None:
    for r in run_distributed(fp16_overflow_on_one_rank, 2):
        assert r["changed"] == [True, False, False, True], r
        assert r["scales"] == [2.0**16, 2.0**15, 2.0**15], r


def test_fp16_tracks_fp32() -> None:
    """With a scale that never overflows here (2^10), fp16 follows the fp32 reference."""
    scaler = DynamicLossScaler(init_scale=2.0**10)
    out = run_distributed(
        zero_train,
        2,
        3,
        STEPS,
        BATCH,
        MICRO,
        torch.float16,
        lr=LR,
        zero_kwargs={**SMALL, "precision": MixedPrecision(loss_scaler=scaler)},
    )
    assert_matches(out[0], reference(2), rtol=0, atol=3e-2, loss_rtol=2e-2)


def construct(**kwargs) -> str:
    """ZeroOptimizer(model, **kwargs)'s error; a policy given as a dict of its fields is built
    here, so that its own validation is the error reported."""
    hidden = 53 + dist.get_rank() if kwargs.pop("uneven", False) else 53
    model = make_model(hidden=hidden)
    try:
        for name, cls in POLICY_CLASSES.items():
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = cls(**kwargs[name])
        ZeroOptimizer(model, **kwargs)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({"optimizer_class": torch.optim.AdamW, "stage": 4}, "stage=4 is not a ZeRO stage"),
        ({"optimizer_class": torch.optim.AdamW, "stage": "2"}, "stage='2' is not a ZeRO stage"),
        ({"optimizer_class": torch.nn.Linear}, "must be a torch.optim.Optimizer subclass"),
        ({"optimizer_class": torch.optim.LBFGS}, "LBFGS is not elementwise"),
        (
            {"optimizer_class": torch.optim.AdamW, "precision": {"param_dtype": torch.int8}},
            "param_dtype=torch.int8 is not supported",
        ),
        ({"optimizer_class": torch.optim.AdamW, "uneven": True}, "the model differs between group ranks 0 and 1"),
    ],
)
def test_bad_input_is_a_clear_error_on_every_rank(kwargs: dict, expected: str) -> None:
    for msg in run_distributed(construct, 2, timeout=60, **kwargs):
        assert expected in msg, msg


def step_without_backward(stage: int) -> bool:
    model = make_model()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=LR, **SMALL)
    idx = torch.randint(0, 37, (4, 8))
    opt.backward(model(idx, idx))
    opt.step()
    opt.zero_grad()
    before = opt.full_state_dict()
    norm = opt.clip_grad_norm_(1.0)
    opt.step()
    after = opt.full_state_dict()
    return float(norm) == 0.0 and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_without_backward_changes_nothing(stage: int) -> None:
    """No stale gradient survives zero_grad (stages 0-1 zero their buffers lazily)."""
    assert all(run_distributed(step_without_backward, 2, stage))


def full_grads_of_one_backward(stage: int) -> dict[str, torch.Tensor]:
    """Each rank's half of one batch through one backward; the optimizer's full gradients."""
    model = make_model()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, **SMALL)
    idx, tgt = batches(1, 8)[0]
    rows = micro_slices(8, dist.get_world_size(), dist.get_rank(), 1)[0]
    opt.backward(model(idx[rows], tgt[rows]))
    return opt.full_grads()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_grads_are_the_single_process_gradients(stage: int) -> None:
    """full_grads() on every rank: each trained parameter's gradient of the whole batch's mean
    loss, as one process computes it (stage 3 with several units)."""
    model = make_model()
    idx, tgt = batches(1, 8)[0]
    model(idx, tgt).backward()
    want = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    for got in run_distributed(full_grads_of_one_backward, 2, stage):
        assert got.keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
