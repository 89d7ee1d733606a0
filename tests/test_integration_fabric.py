"""optim.integrations.fabric: Lightning Fabric's usual loop (setup, no_backward_sync, backward,
clip_gradients, save / load) with a ZeroOptimizer trains like the same loop with Fabric's DDP
strategy and torch's AdamW at stages 0-3, and resumes exactly from sharded and consolidated
checkpoints, also at another world size; under Fabric's own DDP strategy a ZeroOptimizer kept
out of `fabric.setup` trains like the baseline too, and one handed to it is refused in one
sentence. One 2-rank launch trains everything (the `trained` fixture)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("lightning_fabric")

from lightning_fabric import Fabric

from optim import ZeroOptimizer
from optim.integrations.fabric import ZeroStrategy
from optim.policies import Communication
from tests.dist_utils import run_distributed
from tests.models import batches, make_model, micro_slices, no_decay_groups

pytestmark = pytest.mark.slow

WORLD, MICRO, STEPS, SAVE_AT = 2, 2, 10, 5
GLOBAL_BATCH, LR, CLIP = 8, 3e-3, 0.5  # the norms are 1-7: every step is clipped
# several buckets, several stage-3 units (each block's linear layers their own)
SMALL = Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)
RTOL, ATOL = 1e-5, 1e-6


def model_and_optimizer(form: str, stage: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The 4-block TinyLM and its AdamW (decay on matrices only): torch's for the baseline, a
    ZeroOptimizer at `stage` otherwise; `seed` differs for the models a checkpoint is loaded into."""
    model = make_model(seed, n_blocks=4)
    if form == "baseline":
        return model, torch.optim.AdamW(no_decay_groups(model), lr=LR)
    return model, ZeroOptimizer(
        model, torch.optim.AdamW, stage=stage, param_groups=no_decay_groups(model), communication=SMALL, lr=LR
    )


def launched(form: str) -> Fabric:
    strategy = {
        "baseline": "ddp",
        "kept out": "ddp",
        "sharded": ZeroStrategy(),
        "full": ZeroStrategy(state_dict_type="full"),
    }
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy[form])
    fabric.launch()
    return fabric


def set_up(fabric: Fabric, form: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
    """Fabric's setup; "kept out": the model stays out of Fabric, only the optimizer is set up."""
    if form == "kept out":
        return model, fabric.setup_optimizers(opt)
    return fabric.setup(model, opt)


def train(fabric: Fabric, form: str, model: Any, opt: Any, steps: range) -> dict[str, list[float]]:
    """Fabric's usual loop on this rank's part of each global batch, MICRO micro-batches with
    gradient accumulation, clipped at CLIP: each micro-batch's loss and each step's norm."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, list[float]] = {"losses": [], "norms": []}
    for step, (idx, tgt) in enumerate(batches(STEPS, GLOBAL_BATCH)):
        if step not in steps:
            continue
        slices = micro_slices(GLOBAL_BATCH, world, rank, MICRO)
        for k, rows in enumerate(slices):
            last = k == len(slices) - 1
            if form == "kept out":
                quiet = opt.no_sync() if not last else contextlib.nullcontext()
            else:
                quiet = fabric.no_backward_sync(model, enabled=not last)
            with quiet:
                loss = model(idx[rows], tgt[rows])
                fabric.backward(loss / len(slices))
            out["losses"].append(loss.item())
        out["norms"].append(float(fabric.clip_gradients(model, opt, max_norm=CLIP)))
        opt.step()
        opt.zero_grad()
    return out


def full_weights(form: str, model: Any, opt: Any) -> dict[str, torch.Tensor]:
    if form == "baseline":
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return opt.full_state_dict()


def run(form: str, stage: int, root: Path) -> dict[str, Any]:
    """STEPS steps straight, saving at SAVE_AT; then a fresh model and optimizer (another
    seed) loaded from that checkpoint for the remaining steps."""
    path = root / f"{form}-{stage}"
    fabric = launched(form)
    model, opt = set_up(fabric, form, *model_and_optimizer(form, stage, seed=0))
    straight = train(fabric, form, model, opt, range(SAVE_AT))
    fabric.save(path, {"model": model, "optimizer": opt, "step": SAVE_AT})
    later = train(fabric, form, model, opt, range(SAVE_AT, STEPS))
    straight = {k: straight[k] + later[k] for k in straight}

    fabric = launched(form)
    model2, opt2 = set_up(fabric, form, *model_and_optimizer(form, stage, seed=7))
    rest = fabric.load(path, {"model": model2, "optimizer": opt2})
    resumed = train(fabric, form, model2, opt2, range(SAVE_AT, STEPS))
    return {
        "straight": straight,
        "resumed": resumed,
        "rest": rest,
        "weights": full_weights(form, model, opt),
        "resumed_weights": full_weights(form, model2, opt2),
    }


def ddp_refusal(stage: int) -> str:
    """A ZeroOptimizer handed to fabric.setup under Fabric's DDP strategy: the first forward's error."""
    fabric = launched("baseline")
    model, _ = fabric.setup(*model_and_optimizer("zero", stage, seed=0))
    idx, tgt = batches(1, GLOBAL_BATCH)[0]
    try:
        model(idx, tgt)
    except RuntimeError as e:
        return str(e)
    return "no error"


def train_everything(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"baseline": run("baseline", 0, root)}
    for form in ("sharded", "full", "kept out"):
        out[form] = {stage: run(form, stage, root) for stage in range(4)}
    out["refused"] = {stage: ddp_refusal(stage) for stage in range(4)}
    return out


def resume_on_one_rank(root: Path, saved: str, form: str, stage: int) -> dict[str, torch.Tensor]:
    """The 2-rank checkpoint `saved` ("form-stage") loaded by a `form` run on 1 rank at
    `stage`, trained to the end."""
    fabric = launched(form)
    model, opt = set_up(fabric, form, *model_and_optimizer(form, stage, seed=7))
    fabric.load(root / saved, {"model": model, "optimizer": opt})
    train(fabric, form, model, opt, range(SAVE_AT, STEPS))
    return opt.full_state_dict()


# ---- tests ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fabric")


@pytest.fixture(scope="module")
def trained(root: Path) -> list[dict[str, Any]]:
    return run_distributed(train_everything, WORLD, root, timeout=300)


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = RTOL, atol: float = ATOL) -> None:
    assert got.keys() == want.keys()
    for k, value in want.items():
        torch.testing.assert_close(got[k], value, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("form", ["sharded", "full", "kept out"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fabric_loop_equals_fabric_ddp_with_adamw(trained: list[dict[str, Any]], form: str, stage: int) -> None:
    """ZeroStrategy (saving sharded or full checkpoints), or Fabric's DDP strategy with the
    model kept out of setup: every loss of both ranks, every clip norm and the final weights
    equal Fabric's DDP strategy with torch's AdamW, and so do the resumed run's."""
    for rank in trained:
        want, got = rank["baseline"], rank[form][stage]
        for run_name in ("straight", "resumed"):
            for key in ("losses", "norms"):
                assert got[run_name][key] == pytest.approx(want[run_name][key], rel=RTOL), (run_name, key)
        assert min(got["straight"]["norms"]) > CLIP  # clipping was active at every step
        close(got["weights"], want["weights"])
        close(got["resumed_weights"], got["weights"])
        assert got["rest"] == {"step": SAVE_AT}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_optimizer_under_fabrics_ddp_strategy_is_refused(trained: list[dict[str, Any]], stage: int) -> None:
    message = (
        "Fabric's DDP strategy wrapped the model in DistributedDataParallel, but ZeroOptimizer reduces gradients "
        "itself: launch with Fabric(strategy=optim.integrations.fabric.ZeroStrategy())"
    )
    for rank in trained:
        assert rank["refused"][stage] == message


@pytest.mark.parametrize(
    ("saved_form", "saved_stage", "form", "stage"),
    [("sharded", 3, "sharded", 1), ("full", 2, "full", 3), ("kept out", 1, "sharded", 0)],
)
def test_a_checkpoint_loads_at_another_world_size_and_stage(
    trained: list[dict[str, Any]], root: Path, saved_form: str, saved_stage: int, form: str, stage: int
) -> None:
    """A 2-rank checkpoint resumed on 1 rank (its two halves of each batch as micro-batches) at
    another stage ends on the 2-rank run's weights; ZeroStrategy also loads the file Fabric's
    DDP strategy wrote of a ZeroOptimizer kept out of setup."""
    saved = f"{saved_form}-{saved_stage}"
    weights = run_distributed(resume_on_one_rank, 1, root, saved, form, stage, timeout=120)[0]
    close(weights, trained[0][saved_form][saved_stage]["weights"])


# ---- misuse, on one rank ----------------------------------------------------------------------
def refusal(make: Callable[[Path], Any], root: Path) -> str:
    try:
        make(root)
    except Exception as e:  # any exception: its message is what is tested
        return f"{type(e).__name__}: {e}"
    return "no error"


def plain_optimizer(root: Path) -> None:
    fabric = launched("sharded")
    fabric.setup(*model_and_optimizer("baseline", 0, seed=0))


def other_module(root: Path) -> None:
    fabric = launched("sharded")
    _, opt = model_and_optimizer("zero", 2, seed=0)
    fabric.setup(make_model(), opt)


def half_precision(root: Path) -> None:
    Fabric(accelerator="cpu", devices=1, strategy=ZeroStrategy(), precision="bf16-true")


def clip_by_value(root: Path) -> None:
    fabric = launched("sharded")
    model, opt = fabric.setup(*model_and_optimizer("zero", 2, seed=0))
    fabric.clip_gradients(model, opt, clip_val=1.0)


def sharded_without_objects(root: Path) -> None:
    fabric = launched("sharded")
    model, opt = fabric.setup(*model_and_optimizer("zero", 2, seed=0))
    fabric.save(root / "misuse", {"model": model, "optimizer": opt})
    fabric.load(root / "misuse")


MISUSE = {
    "a torch optimizer": (
        plain_optimizer,
        "TypeError: ZeroStrategy trains with the ZeroOptimizer you build over the model, not a AdamW",
    ),
    "a ZeroOptimizer over another module": (
        other_module,
        "ValueError: fabric.setup got a ZeroOptimizer built over another module",
    ),
    "bf16-true": (
        half_precision,
        "ValueError: ZeroStrategy supports precision '32-true' or 'bf16-mixed', not 'bf16-true'",
    ),
    "clip by value": (clip_by_value, "ValueError: ZeroStrategy clips gradients only by their global norm"),
    "a sharded checkpoint without objects": (
        sharded_without_objects,
        "ValueError: .* is a sharded checkpoint, which loads into objects",
    ),
}


def one_rank_checks(root: Path) -> dict[str, Any]:
    """Each MISUSE case's error ("Type: message"); two steps under precision="bf16-mixed"."""
    misuse = {name: refusal(make, root) for name, (make, _) in MISUSE.items()}
    fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroStrategy(), precision="bf16-mixed")
    fabric.launch()
    model, opt = fabric.setup(*model_and_optimizer("zero", 2, seed=0))
    before = opt.full_state_dict()
    norms = train(fabric, "sharded", model, opt, range(2))["norms"]
    after = opt.full_state_dict()
    bf16 = {
        "finite": all(torch.isfinite(torch.tensor(norms))) and all(v.isfinite().all() for v in after.values()),
        "changed": not torch.equal(after["emb.weight"], before["emb.weight"]),
        "dtypes": {str(v.dtype) for v in after.values() if v.is_floating_point()},
    }
    return {"misuse": misuse, "bf16": bf16}


@pytest.fixture(scope="module")
def one_rank(root: Path) -> dict[str, Any]:
    return run_distributed(one_rank_checks, 1, root, timeout=120)[0]


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_is_refused_in_one_sentence(one_rank: dict[str, Any], case: str) -> None:
    assert re.match(MISUSE[case][1], one_rank["misuse"][case]), one_rank["misuse"][case]


def test_bf16_mixed_trains_with_fp32_weights(one_rank: dict[str, Any]) -> None:
    assert one_rank["bf16"] == {"finite": True, "changed": True, "dtypes": {"torch.float32"}}
