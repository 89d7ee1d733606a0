"""ZeroStrategy (optim.integrations.lightning): Lightning with ZeroOptimizer trains as plain
torch + DDP would, resumes exactly from its sharded checkpoints, and refuses misuse in one
sentence. One 2-rank launch trains every stage (the ranks import Lightning once, ~5 s)."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, Dataset

from optim import ZeroOptimizer
from optim.policies import Communication, MixedPrecision
from parallel import accounting
from tests.dist_utils import run_distributed
from tests.models import make_model, no_decay_groups

pytest.importorskip("pytorch_lightning")

import pytorch_lightning as pl

from optim.integrations.lightning import ZeroStrategy

pytestmark = pytest.mark.slow

WORLD, MICRO_BATCH, ACCUM, STEPS = 2, 4, 2, 10
SAMPLES = 5 * WORLD * ACCUM * MICRO_BATCH  # an epoch is 5 optimizer steps
SEQ, VOCAB, LR, CLIP = 8, 37, 3e-3, 1.0
# several buckets and stage-3 units
SMALL = {"communication": Communication(bucket_numel=1500, unit_numel=500, resident_numel=100)}


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


class Tokens(Dataset):
    """SAMPLES fixed token sequences: (index, inputs, targets)."""

    def __init__(self) -> None:
        self.data = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.data[i, :-1], self.data[i, 1:]


class LitTiny(pl.LightningModule):
    """tests.models.TinyLM (tied embedding, a frozen layer, a buffer) trained with AdamW
    (weight decay on matrices only) and a warmup; records the sample indices it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model(n_blocks=2)
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, idx, tgt = batch
        self.seen.append(ids.tolist())
        return self.net(idx, tgt)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[1], batch[2])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(no_decay_groups(self.net), lr=LR)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, warmup), "interval": "step"},
        }

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(), batch_size=MICRO_BATCH, shuffle=True)


class ManualLit(LitTiny):
    """The same training written with manual optimization: accumulation under
    toggle_model(sync_grad=False), clipping through self.clip_gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt, last = self.optimizers(), (batch_idx + 1) % ACCUM == 0
        with opt.toggle_model(sync_grad=last):
            self.manual_backward(super().training_step(batch, batch_idx) / ACCUM)
        if last:
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()


def make_trainer(strategy: ZeroStrategy | str, root: Path, devices: int = WORLD, **overrides: Any) -> pl.Trainer:
    """The tests' Trainer: fp32 on the CPU, deterministic, quiet; 10 steps of accumulation 2
    clipped to norm 1.0 unless `overrides` say otherwise."""
    options = {
        "max_steps": STEPS,
        "accumulate_grad_batches": ACCUM,
        "gradient_clip_val": CLIP,
        "enable_checkpointing": False,
        **overrides,
    }
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        **options,
    )


def local_optimizer_state(opt: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of every optimizer state tensor, by parameter name and key."""
    out = {}
    for name, entries in opt.state_dict()["state"].items():
        for key, value in entries.items():
            pieces = [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]
            out[f"{name}.{key}"] = torch.cat([p.reshape(-1) for p in pieces]).clone()
    return out


def reference_weights(seen: list[list[list[int]]]) -> dict[str, torch.Tensor]:
    """Plain torch in one process on the ranks' micro-batches (`seen[rank][micro]`): each
    step's gradient is the mean over ranks (DDP) and micro-batches (Lightning divides the
    loss by accumulate_grad_batches), clipped to norm CLIP, then AdamW and the warmup."""
    data = Tokens().data
    net = make_model(n_blocks=2)
    opt = torch.optim.AdamW(no_decay_groups(net), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    for step in range(STEPS):
        for rank_seen in seen:
            for ids in rank_seen[step * ACCUM : (step + 1) * ACCUM]:
                batch = data[ids]
                (net(batch[:, :-1], batch[:, 1:]) / (WORLD * ACCUM)).backward()
        torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def resume(root: Path, stage: int, seen: list[list[int]], straight: ZeroStrategy) -> dict[str, Any]:
    """A fresh Trainer at `stage` resumed from that run's step-5 checkpoint for the last 5
    steps: what it ended with, next to the straight run's."""
    resumed, strategy = LitTiny(), ZeroStrategy(stage, **SMALL)
    trainer = make_trainer(strategy, root)
    trainer.fit(resumed, ckpt_path=str(root / f"ckpt{stage}" / "epoch=0-step=5.ckpt"))
    return {
        "weights": strategy.full_state_dict(),
        "seen_equal": resumed.seen == seen[STEPS // 2 * ACCUM :],
        "global_step": trainer.global_step,
        "lr": (strategy.zero_optimizer.param_groups[0]["lr"], straight.zero_optimizer.param_groups[0]["lr"]),
        "state": (local_optimizer_state(strategy.zero_optimizer), local_optimizer_state(straight.zero_optimizer)),
    }


def train_everything(root: Path) -> dict[str, Any]:
    """On each rank: 10 steps at stages 0-3 (checkpointing every 5 steps) and with manual
    optimization at stage 2; resume each stage from step 5; validate a fresh module from
    stage 3's step-10 checkpoint. Rank 0 adds the single-process reference."""
    out: dict[str, Any] = {"weights": {}, "lr_warnings": [], "wrapped": []}
    seen, strategies = {}, {}
    runs = [(0, LitTiny), (1, LitTiny), (2, LitTiny), (3, LitTiny), ("manual", ManualLit), ("compiled", LitTiny)]
    for name, cls in runs:
        stage = {"manual": 2, "compiled": 3}.get(name, name)
        module, strategy = cls(), ZeroStrategy(stage, **SMALL)
        lightning_module = module  # what Lightning trains (it unwraps a compiled module)
        if name == "compiled":  # Lightning's compile switch: fit the torch.compile'd module
            module = torch.compile(module, backend="aot_eager")
        every5 = pl.callbacks.ModelCheckpoint(root / f"ckpt{name}", every_n_train_steps=5, save_top_k=-1)
        ckpt = [every5] if name in range(4) else []
        trainer = make_trainer(
            strategy,
            root,
            callbacks=ckpt,
            enable_checkpointing=bool(ckpt),
            **({"gradient_clip_val": None, "accumulate_grad_batches": 1} if name == "manual" else {}),
        )
        with warnings.catch_warnings(record=True) as caught, accounting.tracking() as log:
            warnings.simplefilter("always")
            trainer.fit(module)
        if name == "compiled":
            out["compiled_graphs"] = counters["stats"]["unique_graphs"]
        if name == 2:
            out["reduce_scatters"] = log.calls(op="reduce_scatter_tensor")
            out["buckets"] = len(strategy.zero_optimizer.buckets)
        out["lr_warnings"] += [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
        out["wrapped"].append(trainer.strategy.model is not lightning_module)
        out["weights"][name] = strategy.full_state_dict()
        seen[name], strategies[name] = module.seen, strategy

    out["resume"] = {stage: resume(root, stage, seen[stage], strategies[stage]) for stage in range(4)}

    strategies[3].save_full_weights(root / "full.pt")
    out["saved_full"] = torch.load(root / "full.pt")
    fresh = LitTiny()
    make_trainer(ZeroStrategy(3, **SMALL), root).validate(
        fresh,
        DataLoader(Tokens(), batch_size=MICRO_BATCH),
        ckpt_path=str(root / "ckpt3" / "epoch=1-step=10.ckpt"),
        verbose=False,
    )
    out["validated"] = {k: v.clone() for k, v in fresh.state_dict().items()}

    everyone = [None] * WORLD
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() == 0:
        out["seen"] = everyone
        out["reference"] = {name: reference_weights([s[name] for s in everyone]) for name in seen}
    return out


# ---- misuse ---------------------------------------------------------------------------------
class TwoOptimizers(LitTiny):  # manual optimization: Lightning itself refuses two in automatic
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD(self.net.blocks.parameters(), lr=LR),
            torch.optim.SGD(self.net.norm.parameters(), lr=LR),
        ]


class NoOptimizer(LitTiny):
    def configure_optimizers(self) -> None:
        return None


class ParameterLeftOut(LitTiny):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.net.blocks.parameters(), lr=LR)


class OwnZero(LitTiny):
    """configure_optimizers builds its own ZeroOptimizer at `stage`."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def configure_optimizers(self) -> Any:
        self.built = ZeroOptimizer(self, torch.optim.AdamW, stage=self.stage, lr=LR)
        return self.built


class OwnZeroOverSubmodule(LitTiny):
    def configure_optimizers(self) -> Any:
        return ZeroOptimizer(self.net, torch.optim.AdamW, stage=2, lr=LR)


def fit_once(root: Path, module: pl.LightningModule, strategy: ZeroStrategy | None = None, **kwargs: Any) -> None:
    make_trainer(strategy or ZeroStrategy(2), root, devices=1, max_steps=1, **kwargs).fit(module)


def fit_twice(root: Path) -> None:
    module = LitTiny()
    fit_once(root, module)
    fit_once(root, module)


MISUSE = {
    "two optimizers": (
        lambda root: fit_once(root, TwoOptimizers(), accumulate_grad_batches=1, gradient_clip_val=None),
        "configure_optimizers returned 2 optimizers; ZeroStrategy trains with exactly one",
    ),
    "no optimizer": (
        lambda root: fit_once(root, NoOptimizer()),
        "configure_optimizers returned 0 optimizers; ZeroStrategy trains with exactly one",
    ),
    "parameter left out": (
        lambda root: fit_once(root, ParameterLeftOut()),
        "parameter net.emb.weight requires grad but is in no param group",
    ),
    "own ZeroOptimizer, other stage": (
        lambda root: fit_once(root, OwnZero(1)),
        r"its own ZeroOptimizer \(stage 1\) under ZeroStrategy\(stage=2\)",
    ),
    "own ZeroOptimizer over a submodule": (
        lambda root: fit_once(root, OwnZeroOverSubmodule()),
        "a ZeroOptimizer over a submodule; build it over the LightningModule",
    ),
    "clip by value": (
        lambda root: fit_once(root, LitTiny(), gradient_clip_algorithm="value"),
        "clips gradients only by their global norm",
    ),
    "sync batchnorm": (
        lambda root: fit_once(root, LitTiny(), sync_batchnorm=True),
        "does not convert BatchNorm to SyncBatchNorm",
    ),
    "fit twice": (fit_twice, "already belong to a ZeroOptimizer from an earlier fit"),
    "not a checkpoint": (
        lambda root: make_trainer(ZeroStrategy(2), root, devices=1).fit(LitTiny(), ckpt_path=str(root)),
        "is not a ZeroStrategy checkpoint",
    ),
    "Lightning's own DDP strategy": (
        lambda root: make_trainer("ddp", root, devices=1, max_steps=1).fit(OwnZero(3)),
        r"^RuntimeError: Lightning's DDP strategy wrapped the LightningModule in DistributedDataParallel, but "
        r"ZeroOptimizer reduces gradients itself: train with pl\.Trainer\(strategy=optim\.integrations\.lightning\."
        r"ZeroStrategy\(stage=3\)\)$",
    ),
}


class AutocastProbe(LitTiny):
    """Records the autocast dtype its training steps run under."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append([str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else "off"])
        return self.net(batch[1], batch[2])


def one_rank_checks(root: Path) -> dict[str, Any]:
    """On one rank: each MISUSE case's error as "Type: message" ("no error" if none); whether
    a ZeroOptimizer that configure_optimizers built at the strategy's stage is the one
    trained; two steps under precision="bf16-mixed" with bf16 compute weights."""
    misuse = {}
    for name, (run, _) in MISUSE.items():
        try:
            run(root)
            misuse[name] = "no error"
        except Exception as e:  # any exception: its message is what is tested
            misuse[name] = f"{type(e).__name__}: {e}"
    promised = ZeroStrategy(2, communication=Communication(find_unused_parameters=False))
    fit_once(root, LitTiny(), promised)
    own, strategy = OwnZero(2), ZeroStrategy(2)
    fit_once(root, own, strategy)
    trained = not torch.equal(strategy.full_state_dict()["net.emb.weight"], LitTiny().net.emb.weight)
    taken = strategy.zero_optimizer is own.built and trained
    module, strategy = AutocastProbe(), ZeroStrategy(2, precision=MixedPrecision(torch.bfloat16))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    make_trainer(strategy, root, devices=1, max_steps=2, precision="bf16-mixed").fit(module)
    after = strategy.full_state_dict()
    bf16 = {
        "autocast": module.seen,
        "finite": all(v.isfinite().all() for v in after.values() if v.is_floating_point()),
        "changed": not torch.equal(after["net.emb.weight"], before["net.emb.weight"]),
        "dtypes": {str(v.dtype) for v in after.values()},
    }
    return {
        "misuse": misuse,
        "bf16": bf16,
        "own ZeroOptimizer taken": taken,
        "find_unused_parameters": promised.zero_optimizer.communication.find_unused_parameters,
    }


# ---- tests ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(train_everything, WORLD, tmp_path_factory.mktemp("lightning"), timeout=240)


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for k, value in want.items():
        torch.testing.assert_close(got[k], value, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("name", [0, 1, 2, 3, "manual", "compiled"])
def test_lightning_matches_plain_torch(trained: list[dict[str, Any]], name: Any) -> None:
    """Stage `name` (or manual optimization at stage 2, or stage 3 fitting a torch.compile'd
    module) on 2 ranks, accumulation 2, clip 1.0, 10 AdamW steps with warmup: the full weights
    equal a single-process torch loop's over the same micro-batches, on every rank."""
    for rank in trained:
        close(rank["weights"][name], trained[0]["reference"][name])
        assert rank["compiled_graphs"] > 0


def test_each_sample_once_per_epoch(trained: list[dict[str, Any]]) -> None:
    """The ranks' micro-batches (the reference's input) partition every epoch's samples."""
    seen = trained[0]["seen"]  # per rank: run -> its micro-batches' sample indices
    micro_per_epoch = SAMPLES // (WORLD * MICRO_BATCH)
    for name in seen[0]:
        for start in range(0, STEPS * ACCUM, micro_per_epoch):
            ids = sorted(i for rank in seen for batch in rank[name][start : start + micro_per_epoch] for i in batch)
            assert ids == list(range(SAMPLES)), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_from_sharded_checkpoint_is_exact(trained: list[dict[str, Any]], stage: int) -> None:
    """5 steps, Lightning's (DCP-sharded) checkpoint, a fresh Trainer resuming with ckpt_path=
    for 5 more: weights, optimizer state, LR, step and data order equal 10 straight steps
    exactly."""
    for rank in trained:
        resume = rank["resume"][stage]
        assert resume["seen_equal"] and resume["global_step"] == STEPS
        assert resume["lr"][0] == resume["lr"][1]
        close(resume["weights"], rank["weights"][stage], rtol=0, atol=0)
        close(*resume["state"], rtol=0, atol=0)


def test_full_weights_export_and_validate_from_checkpoint(trained: list[dict[str, Any]]) -> None:
    """save_full_weights writes the unsharded module weights; trainer.validate(ckpt_path=)
    loads the sharded stage-3 checkpoint into a plain module (no optimizer) exactly."""
    for rank in trained:
        close(rank["saved_full"], rank["weights"][3], rtol=0, atol=0)
        close(rank["validated"], rank["weights"][3], rtol=0, atol=0)


def test_accumulation_reduces_once_per_step_without_ddp(trained: list[dict[str, Any]]) -> None:
    """The module is never wrapped; under accumulate_grad_batches=2 each bucket is
    reduce-scattered once per optimizer step (the first micro-batch ran under no_sync()); the
    LR scheduler, re-pointed at the ZeroOptimizer, raises no step-order warning."""
    for rank in trained:
        assert not any(rank["wrapped"])
        assert rank["reduce_scatters"] == rank["buckets"] * STEPS
        assert rank["lr_warnings"] == []


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(one_rank_checks, 1, tmp_path_factory.mktemp("one_rank"), timeout=120)[0]


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_is_one_sentence(one_rank: dict[str, Any], case: str) -> None:
    message = one_rank["misuse"][case]
    assert re.search(MISUSE[case][1], message), message


def test_find_unused_parameters_reaches_the_optimizer(one_rank: dict[str, Any]) -> None:
    assert one_rank["find_unused_parameters"] is False


def test_own_zero_optimizer_is_taken(one_rank: dict[str, Any]) -> None:
    """configure_optimizers may return ZeroOptimizer(self, ...) at the strategy's stage."""
    assert one_rank["own ZeroOptimizer taken"]


def test_bf16_mixed(one_rank: dict[str, Any]) -> None:
    """precision="bf16-mixed" runs the steps under bf16 autocast; with MixedPrecision(bf16) the
    weights train, stay finite and come back in their original dtype (fp32)."""
    bf16 = one_rank["bf16"]
    assert bf16["autocast"] == [["torch.bfloat16"]] * 2 * ACCUM
    assert bf16["finite"] and bf16["changed"] and bf16["dtypes"] == {"torch.float32"}


def test_optim_does_not_import_lightning() -> None:
    code = "import sys, optim, optim.integrations; assert 'pytorch_lightning' not in sys.modules and 'lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent, timeout=120)


@pytest.mark.parametrize(
    "make, sentence",
    [
        (lambda: ZeroStrategy(stage=4), "stage=4 is not a ZeRO stage"),
        (lambda: ZeroStrategy(lr=1e-3), "optimizer hyperparameters go to the optimizer configure_optimizers returns"),
        (lambda: ZeroStrategy(precision=MixedPrecision(torch.float16)), "use torch.bfloat16"),
        (
            lambda: pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(), precision="bf16-true"),
            "supports precision '32-true' or 'bf16-mixed', not 'bf16-true'",
        ),
    ],
)
def test_bad_options_refused_at_construction(make: Any, sentence: str) -> None:
    with pytest.raises((ValueError, TypeError), match=re.escape(sentence)):
        make()
