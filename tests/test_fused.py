"""optim.fused: every backend against torch.optim.Adam / AdamW, backend selection, hyperparameters."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from optim import fused
from optim.fused import adam_hyperparams, adam_step_, available_backends, pick_backend
from tests.interpreted import run_interpreted

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
SIZES = (1, 7, 1031)
OUT_DTYPES = (torch.bfloat16, torch.float16, None)  # params_out per size
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
CASES = [  # (grad dtype, adamw, grad_scale, beta1)
    (torch.float32, True, 1.0, 0.9),
    (torch.bfloat16, True, 2.0**-10, 0.9),
    (torch.float16, True, 0.37, 0.9),
    (torch.float32, False, 0.37, 0.9),
    (torch.bfloat16, False, 1.0, 0.3),  # 1 - beta1 >= 0.5 takes torch's other lerp formula
    (torch.float16, False, 2.0**-10, 0.9),
]
EXACT = {"rtol": 0.0, "atol": 0.0}
NEAR = {"rtol": 1e-5, "atol": 1e-7}  # fused kernels round differently: about 1 ulp per step
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case_id(case: tuple) -> str:
    grad_dtype, adamw, grad_scale, beta1 = case
    return f"{str(grad_dtype).removeprefix('torch.')}-{'adamw' if adamw else 'adam'}-gs{grad_scale:g}-b1_{beta1}"


def _reference(adamw: bool, masters0: list[Tensor], grad_steps: list[list[Tensor]], grad_scale: float, hyper: dict):
    """torch.optim.AdamW / Adam (default implementation) with .grad = float32(g) * grad_scale."""
    params = [torch.nn.Parameter(m.clone()) for m in masters0]
    betas = (hyper["beta1"], hyper["beta2"])
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(params, lr=hyper["lr"], betas=betas, eps=hyper["eps"], weight_decay=hyper["weight_decay"])
    for grads in grad_steps:
        for p, g in zip(params, grads):
            p.grad = g.float() * grad_scale
        opt.step()
    states = [opt.state[p] for p in params]
    return [p.detach() for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]


def _max_rel(actual: list[Tensor], expected: list[Tensor]) -> float:
    """max over shards of max|a - e| / max|e|."""
    return max(((a - e).abs().max() / e.abs().max()).item() for a, e in zip(actual, expected))


def run_case(backend: str, device: torch.device, grad_dtype, adamw, grad_scale, beta1, tol: dict, steps: int = 3):
    """`steps` steps of `backend` vs torch.optim on SIZES-long shards: masters and Adam state
    within `tol`, params_out == master.to(dtype) exactly, grads untouched. Returns the max
    relative differences."""
    gen = torch.Generator().manual_seed(0)
    hyper = {**HYPER, "beta1": beta1}
    masters0 = [torch.randn(n, generator=gen).to(device) for n in SIZES]
    grad_steps = [
        [(torch.randn(n, generator=gen) / grad_scale).to(device, grad_dtype) for n in SIZES] for _ in range(steps)
    ]
    masters = [m.clone() for m in masters0]
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    outs = [None if dt is None else torch.empty(n, dtype=dt, device=device) for n, dt in zip(SIZES, OUT_DTYPES)]
    for step, grads in enumerate(grad_steps, start=1):
        before = [g.clone() for g in grads]
        adam_step_(backend, masters, grads, exp_avgs, exp_avg_sqs, outs, **hyper, adamw=adamw, step=step,
                   grad_scale=grad_scale)  # fmt: skip
        assert all(torch.equal(g, b) for g, b in zip(grads, before)), "grads were modified"
        for out, master in zip(outs, masters):
            assert out is None or torch.equal(out, master.to(out.dtype)), f"params_out != master.to({out.dtype})"
    ref = dict(zip(("master", "exp_avg", "exp_avg_sq"), _reference(adamw, masters0, grad_steps, grad_scale, hyper)))
    ours = {"master": masters, "exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs}
    for name in ours:
        for a, e in zip(ours[name], ref[name]):
            torch.testing.assert_close(a, e, **tol, msg=lambda msg, name=name: f"{backend} {name}: {msg}")
    return {name: _max_rel(ours[name], ref[name]) for name in ours}


def check_cast(backend: str, device: torch.device) -> None:
    """With lr = 0 the master stays as is, and params_out must equal master.to(dtype) bit for
    bit on rounding ties, overflow to inf, infs, signed zeros, subnormals and NaN."""
    tie = 1 + 2.0**-8  # halfway between two bf16 values
    special = [tie, 1 + 3 * 2.0**-8, -tie, 65520.0, 3.4028235e38, float("inf"), -float("inf"), -0.0, 0.0, 1e-40,
               2.0**-25, float("nan")]  # fmt: skip
    randoms = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 1e3
    master = torch.cat([torch.tensor(special), randoms]).to(device)
    zeros = torch.zeros_like(master)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty_like(master, dtype=dtype)
        adam_step_(backend, [master], [zeros], [zeros.clone()], [zeros.clone()], [out], **{**HYPER, "lr": 0.0},
                   adamw=True, step=1)  # fmt: skip
        expected = master.to(dtype)
        bad = (out.view(torch.int16) != expected.view(torch.int16)) & ~(out.isnan() & expected.isnan())
        assert not bad.any(), f"{backend} {dtype}: {master[bad].tolist()} -> {out[bad].tolist()}, not {expected[bad]}"


# ---- numerics --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("backend", available_backends(CPU))
def test_cpu_backend_matches_torch_optim(backend: str, case: tuple):
    """The "torch" backend is bitwise torch.optim on CPU; the others are within NEAR."""
    run_case(backend, CPU, *case, tol=EXACT if backend == "torch" else NEAR)
    check_cast(backend, CPU)


@pytest.mark.parametrize("backend", available_backends(CPU))
def test_empty_shards(backend: str):
    adam_step_(backend, [], [], [], [], [], **HYPER, adamw=True, step=1)
    empty = [torch.zeros(0)]
    adam_step_(backend, empty, empty, empty, empty, [torch.zeros(0, dtype=torch.bfloat16)], **HYPER, adamw=True, step=1)


def interpreter_report() -> dict[str, dict[str, float]]:
    """Run in a TRITON_INTERPRET=1 process: triton on CPU tensors vs torch.optim."""
    test_empty_shards("triton")
    check_cast("triton", CPU)
    return {_case_id(case): run_case("triton", CPU, *case, tol=NEAR) for case in CASES}


@pytest.mark.slow
def test_triton_interpreter_matches_torch_optim():
    assert len(run_interpreted("tests.test_fused", "interpreter_report")) == len(CASES)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "torch_fused", "apex", "torch"])
def test_cuda_backend_matches_torch_optim(backend: str):
    """apex and triton are skipped where they are not installed."""
    if backend not in available_backends(CUDA):
        pytest.skip(f"{backend} is not available on cuda")
    check_cast(backend, CUDA)
    for case in CASES:
        run_case(backend, CUDA, *case, tol=NEAR)


@pytest.mark.cuda
@needs_cuda
def test_cuda_triton_matches_torch_fused():
    """Large unaligned shard views (offset 3 into a flat buffer), bf16 grads and bf16 params."""
    pytest.importorskip("triton")
    n = 3 * 2**20 + 5
    results = {}
    for backend in ("triton", "torch_fused"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        master, exp_avg, exp_avg_sq = (torch.zeros(n + 3, device="cuda")[3:] for _ in range(3))
        master.copy_(torch.randn(n, device="cuda", generator=gen))
        out = torch.empty(n + 3, dtype=torch.bfloat16, device="cuda")[3:]
        for step in range(1, 4):
            grad = (torch.randn(n, device="cuda", generator=gen) * 1024).to(torch.bfloat16)
            adam_step_(backend, [master], [grad], [exp_avg], [exp_avg_sq], [out], **HYPER, adamw=True, step=step,
                       grad_scale=2.0**-10)  # fmt: skip
        results[backend] = (master, exp_avg, exp_avg_sq, out)
    for a, b in zip(results["triton"][:3], results["torch_fused"][:3]):
        torch.testing.assert_close(a, b, **NEAR)
    assert torch.equal(results["triton"][3], results["triton"][0].to(torch.bfloat16))


# ---- backend selection -----------------------------------------------------------------------
def test_cpu_default_is_torch_fused():
    assert pick_backend(CPU) == "torch_fused"
    assert pick_backend("cpu", "torch") == "torch"
    assert available_backends(CPU)[:2] == ["torch_fused", "torch"]


@pytest.mark.parametrize(
    ("triton_ok", "apex_ok", "expected"),
    [(True, True, "triton"), (False, True, "apex"), (False, False, "torch_fused")],
)
def test_cuda_auto_preference(monkeypatch, triton_ok: bool, apex_ok: bool, expected: str):
    monkeypatch.setattr(fused, "triton_runs_on", lambda device: triton_ok)
    monkeypatch.setattr(fused, "_apex_kernels", lambda: object() if apex_ok else None)
    assert pick_backend(CUDA) == expected
    assert available_backends(CUDA)[-2:] == ["torch_fused", "torch"]


def test_unavailable_request_names_available_ones(monkeypatch):
    monkeypatch.setattr(fused, "triton_runs_on", lambda device: False)
    with pytest.raises(ValueError, match=r"'triton' is not available on cpu; available: torch_fused, torch\.$"):
        pick_backend(CPU, "triton")
    with pytest.raises(ValueError, match="'apex' is not available on cpu"):
        pick_backend(CPU, "apex")
    with pytest.raises(ValueError, match="'nope' is not available"):
        pick_backend(CPU, "nope")


def test_step_rejects_bad_input():
    m = [torch.zeros(4)]
    with pytest.raises(ValueError, match="unknown Adam backend"):
        adam_step_("nope", m, m, m, m, [None], **HYPER, adamw=True, step=1)
    with pytest.raises(ValueError, match="step=0"):
        adam_step_("torch", m, m, m, m, [None], **HYPER, adamw=True, step=0)
    with pytest.raises(ValueError, match="one size"):
        adam_step_("torch", m, [torch.zeros(5)], m, m, [None], **HYPER, adamw=True, step=1)
    with pytest.raises(ValueError, match="float32"):
        adam_step_("torch", [torch.zeros(4, dtype=torch.bfloat16)], m, m, m, [None], **HYPER, adamw=True, step=1)


# ---- hyperparameters from torch param groups ---------------------------------------------------
def _group(cls: type, **kwargs) -> dict:
    return cls([torch.nn.Parameter(torch.zeros(2))], **kwargs).param_groups[0]


def test_adam_hyperparams_from_groups():
    kwargs = {"lr": 0.5, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.25}
    expected = {"lr": 0.5, "beta1": 0.8, "beta2": 0.9, "eps": 1e-6, "weight_decay": 0.25}
    assert adam_hyperparams(_group(torch.optim.AdamW, **kwargs), torch.optim.AdamW) == {**expected, "adamw": True}
    assert adam_hyperparams(_group(torch.optim.Adam, **kwargs), torch.optim.Adam) == {**expected, "adamw": False}
    decoupled = _group(torch.optim.Adam, **kwargs, decoupled_weight_decay=True)
    assert adam_hyperparams(decoupled, torch.optim.Adam)["adamw"] is True
    tensors = _group(torch.optim.AdamW, lr=torch.tensor(0.5), betas=(torch.tensor(0.75), torch.tensor(0.875)))
    hyper = adam_hyperparams(tensors, torch.optim.AdamW)
    assert (hyper["lr"], hyper["beta1"], hyper["beta2"]) == (0.5, 0.75, 0.875)
    assert all(type(v) is float for k, v in hyper.items() if k != "adamw")


@pytest.mark.parametrize("option", ["amsgrad", "maximize", "differentiable"])
def test_adam_hyperparams_refuses_unsupported_options(option: str):
    assert adam_hyperparams(_group(torch.optim.AdamW, **{option: True}), torch.optim.AdamW) is None


def test_adam_hyperparams_refuses_other_optimizers():
    class MyAdamW(torch.optim.AdamW):
        pass

    assert adam_hyperparams(_group(torch.optim.SGD, lr=0.1), torch.optim.SGD) is None
    assert adam_hyperparams(_group(MyAdamW), MyAdamW) is None
