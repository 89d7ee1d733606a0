"""ZeroOptimizer under ordinary PyTorch habits, against torch.optim on the same batches:
parameters without a gradient are not stepped (unused, used on one rank or some steps,
requires_grad toggled), each keeps its own step count; `model.zero_grad()`,
`zero_grad(set_to_none=False)` and `torch.nn.utils.clip_grad_norm_` act as in torch; and
each misuse that would train differently raises one sentence on every rank."""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from optim import ZeroOptimizer
from optim.policies import Communication
from parallel import accounting
from tests.conftest import slow_except
from tests.dist_utils import run_distributed

STEPS = 7
OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {"lr": 1e-2}),
    "AdamW-maximize": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "maximize": True}),
    "SGD": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
}
SMALL = {"communication": Communication(bucket_numel=100, unit_numel=60, resident_numel=10)}


class Gated(nn.Module):
    """`sometimes` runs on rank-dependent steps, `never` never runs, `toggled` is frozen for
    some steps: the cases where torch leaves a parameter's .grad at None."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.sometimes = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.toggled = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if use_sometimes:
            h = h + torch.tanh(self.sometimes(h))
        return self.out(h + self.toggled(h))


def uses_sometimes(step: int, rank: int) -> bool:
    """Rank-dependent; stage 3 gathers a module's parameters when it runs, so there (as under
    FSDP) every rank must run the same modules: `rank` is then 0 for all."""
    return (step + rank) % 3 == 0


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def train(
    model: Gated,
    opt: torch.optim.Optimizer,
    rank_batches: list[int],
    zero: str,
    clip: float | None,
    same_modules: bool,
    steps: range = range(STEPS),
) -> list[float]:
    """The given steps; each step's loss is the mean over `rank_batches` (one rank's under
    ZeRO, both ranks' in the single-process reference, as DDP averages them)."""
    norms = []
    for step in steps:
        model.toggled.weight.requires_grad_(step not in (2, 3, 4))
        losses = [
            F.cross_entropy(model(x, uses_sometimes(step, 0 if same_modules else r)), y)
            for r in rank_batches
            for x, y in [batch(step, r)]
        ]
        (sum(losses) / len(losses)).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if zero == "model":
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=zero != "opt-keep")
    model.toggled.weight.requires_grad_(True)
    return norms


def parity(stage: int, name: str, zero: str, clip: float | None) -> dict:
    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    reference = Gated()
    torch.manual_seed(0)
    model = Gated()
    ref_norms = train(reference, cls(reference.parameters(), **kwargs), [0, 1], zero, clip, stage == 3)
    opt = ZeroOptimizer(model, cls, stage=stage, **SMALL, **kwargs)
    norms = train(model, opt, [dist.get_rank()], zero, clip, stage == 3)
    full = opt.full_state_dict()
    worst = max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())
    torch.manual_seed(0)
    never_moved = torch.equal(full["never.weight"], Gated().never.weight)
    return {"worst": worst, "norms": norms, "ref_norms": ref_norms, "never_moved": never_moved}


def parity_cases(stage: int) -> dict:
    cases = {(name, zero, None) for name in OPTIMIZERS for zero in ("opt", "model", "opt-keep")}
    cases |= {("AdamW-maximize", "model", 0.05), ("SGD", "opt", 0.05)}
    return {case: parity(stage, *case) for case in sorted(cases, key=str)}


@pytest.mark.parametrize("stage", slow_except([3], [0, 1, 2]))
def test_parameters_without_gradients_match_torch(stage: int) -> None:
    results = run_distributed(parity_cases, 2, stage, timeout=240)
    for case, r in results[0].items():
        assert r["worst"] < 2e-6, (case, r["worst"])
        assert r["never_moved"], case
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), case
        assert results[1][case] == r, case  # every rank holds the same weights and saw the same norms


# ---- misuse: one sentence on every rank, never a hang -----------------------------------
def misuse(stage: int, what: str) -> str:
    torch.manual_seed(0)
    model = Gated()
    model.toggled.weight.requires_grad_(what != "unfrozen")
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, **SMALL)
    x, y = batch(0, dist.get_rank())
    try:
        if what == "unfrozen":
            model.toggled.weight.requires_grad_(True)
        elif what == "cast":
            model.double()
        elif what == "replaced":
            model.out.weight = nn.Parameter(torch.zeros(3, 8))
        elif what == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        loss = F.cross_entropy(model(x, True), y)
        loss.backward()
        if what == "hand-grad" and dist.get_rank() == 1:  # on one rank only: the other must not hang
            model.never.weight.grad = torch.ones_like(model.never.weight)
        elif what == "clip-value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "what,sentence",
    [
        ("cast", "no longer lives in ZeroOptimizer's buffers"),
        ("replaced", "has a gradient but ZeroOptimizer does not train it"),
        ("unfrozen", "has a gradient but ZeroOptimizer does not train it"),
        ("ddp", "do not wrap it in DDP"),
        ("hand-grad", "was assigned by hand"),
        ("clip-value", "holds no values"),
    ],
)
@pytest.mark.parametrize("stage", [1, 3])
def test_misuse_raises_one_sentence(stage: int, what: str, sentence: str) -> None:
    messages = run_distributed(misuse, 2, stage, what, timeout=60)
    assert all(sentence in m for m in messages), messages


# ---- an optimizer per model: a dropped one is freed, a second one over a model is refused ----
def dropped_and_second(stage: int) -> tuple[bool, bool, str]:
    """Trains a model two steps, drops model and optimizer (are both collected, with their
    buffers?), then builds a second optimizer over a model that already has one."""
    torch.manual_seed(0)
    model = dense()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2, **SMALL)
    for step in range(2):
        x, y = batch(step, dist.get_rank())
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)
    del model, opt
    gc.collect()
    kept = model_ref() is not None, opt_ref() is not None
    model = dense()
    ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2, **SMALL)
    try:
        ZeroOptimizer(model[2], torch.optim.SGD, stage=stage, lr=1e-2, **SMALL)
        return (*kept, "no error")
    except ValueError as e:
        return (*kept, str(e))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dropped_optimizer_is_freed_and_a_second_is_refused(stage: int) -> None:
    for model_kept, opt_kept, second in run_distributed(dropped_and_second, 2, stage, timeout=60):
        assert not model_kept and not opt_kept  # nothing the hooks hold keeps them alive
        assert "already trained by a ZeroOptimizer" in second


# ---- find_unused_parameters=False: DDP's default promise, no flag all-reduces --------------
def dense() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def promised(stage: int) -> dict:
    """Three clipped steps of a model that uses every parameter, with and without the promise
    (equal weights, and the all-reduces it saves); then a parameter unused on every rank, and
    one unused on rank 1 only: the rank that misses a gradient raises."""
    out, rank = {}, dist.get_rank()
    for find in (True, False):
        model = dense()
        communication = dataclasses.replace(SMALL["communication"], find_unused_parameters=find)
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, communication=communication, lr=1e-2)
        with accounting.tracking() as log:
            for step in range(3):
                x, y = batch(step, rank)
                F.cross_entropy(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                opt.step()
                opt.zero_grad()
        out[find] = (opt.full_state_dict(), log.calls(op="all_reduce"))
    cases = {"unused everywhere": lambda r: False, "unused on rank 1": lambda r: r == 0}
    for case, uses in list(cases.items())[: 1 if stage == 3 else 2]:  # stage 3: same modules on every rank
        torch.manual_seed(0)
        model = Gated()
        model.never.requires_grad_(False)  # never used: frozen before the optimizer, as the sentence says
        communication = dataclasses.replace(SMALL["communication"], find_unused_parameters=False)
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, communication=communication, lr=1e-2)
        try:
            x, y = batch(0, rank)
            F.cross_entropy(model(x, uses(rank)), y).backward()
            opt.step()
            out[case] = "no error"
        except RuntimeError as e:
            out[case] = str(e)
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_find_unused_parameters_false_skips_the_flag_all_reduces(stage: int) -> None:
    outs = run_distributed(promised, 2, stage, timeout=60)
    for out in outs:
        (found, found_calls), (promise, promise_calls) = out[True], out[False]
        for name, value in found.items():
            assert torch.equal(promise[name], value), name
        assert found_calls - promise_calls == 2 * 3  # two flag all-reduces per step
        assert "got no gradient in this step" in out["unused everywhere"]
    if stage < 3:  # rank 0 steps (stage 0) or its post-step all-gather finds rank 1 gone (stage 2); no hang
        assert outs[0]["unused on rank 1"] == "no error" or "Connection" in outs[0]["unused on rank 1"]
        assert "parameter 'sometimes." in outs[1]["unused on rank 1"]


# ---- state dicts users reach for: torch.save per rank, torch.optim's own ----------------
def state_dict_habits(stage: int, folder: str) -> dict:
    rank, first, rest = dist.get_rank(), range(3), range(3, STEPS)
    hyper = {"lr": 1e-2, "weight_decay": 0.1}
    torch.manual_seed(0)
    reference = Gated()
    ref_opt = torch.optim.AdamW(reference.parameters(), **hyper)
    train(reference, ref_opt, [0, 1], "opt", None, True, first)
    torch_sd, weights = copy.deepcopy(ref_opt.state_dict()), copy.deepcopy(reference.state_dict())
    train(reference, ref_opt, [0, 1], "opt", None, True, rest)

    def fresh(from_weights: dict | None = None) -> tuple[Gated, ZeroOptimizer]:
        torch.manual_seed(0)
        model = Gated()
        if from_weights is not None:
            model.load_state_dict(from_weights)
        return model, ZeroOptimizer(model, torch.optim.AdamW, stage=stage, **SMALL, **hyper)

    def worst(opt: ZeroOptimizer) -> float:
        full = opt.full_state_dict()
        return max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())

    out = {}
    model, opt = fresh(weights)
    opt.load_state_dict(torch_sd)
    train(model, opt, [rank], "opt", None, True, rest)
    out["from torch.optim"] = worst(opt)

    model, opt = fresh()
    train(model, opt, [rank], "opt", None, True, first)
    torch.save(opt.state_dict(), f"{folder}/rank{rank}.pt")
    model, opt = fresh()
    opt.load_state_dict(torch.load(f"{folder}/rank{rank}.pt"))
    train(model, opt, [rank], "opt", None, True, rest)
    out["torch.save per rank"] = worst(opt)

    wrong = {
        "rank 0's file everywhere": lambda: torch.load(f"{folder}/rank0.pt"),
        "SGD's state": lambda: torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9).state_dict(),
        "another dict": lambda: {"weights": 1},
    }
    for name, load in wrong.items():
        try:
            opt.load_state_dict(load())
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_state_dicts_users_reach_for(stage: int, tmp_path) -> None:
    for out in run_distributed(state_dict_habits, 2, stage, str(tmp_path), timeout=120):
        assert out["from torch.optim"] < 2e-6, out
        assert out["torch.save per rank"] < 2e-6, out
        assert "torch.save it on every rank to a file of its own" in out["rank 0's file everywhere"], out
        assert "another optimizer class" in out["SGD's state"] or "param groups" in out["SGD's state"], out
        assert "not a ZeroOptimizer state dict" in out["another dict"], out


# ---- torch.compile ------------------------------------------------------------------------
def compiled_training(stage: int, backend: str) -> dict:
    """Three steps through torch.compile(model, backend=backend) and three eager ones."""
    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Gated()
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2, **SMALL)
        run = torch.compile(model, backend=backend) if compiled else model
        try:
            for step in range(3):
                x, y = batch(step, dist.get_rank())
                F.cross_entropy(run(x, True), y).backward()
                opt.step()
                opt.zero_grad()
            out[compiled] = opt.full_state_dict()
        except RuntimeError as e:
            out[compiled] = str(e)
    return out


@pytest.mark.parametrize(
    "stage,backend",
    slow_except([(3, "aot_eager")], [(0, "aot_eager"), (2, "aot_eager"), (2, "inductor"), (3, "inductor")]),
)
def test_torch_compile_of_the_whole_model_trains_like_eager(stage: int, backend: str) -> None:
    """torch.compile(model) after the optimizer is built (nanoGPT's habit): at stage 3 the
    gather and free hooks run eagerly between compiled graphs (several units here)."""
    for out in run_distributed(compiled_training, 2, stage, backend, timeout=180):
        assert isinstance(out[True], dict), out[True]
        for name, eager in out[False].items():
            torch.testing.assert_close(out[True][name], eager, rtol=1e-5, atol=1e-6)
