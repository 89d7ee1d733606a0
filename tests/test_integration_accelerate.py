"""optim.integrations.accelerate: accelerate's documented loop (prepare, accumulate, backward,
clip_grad_norm_, save_state / load_state) with a ZeroOptimizer trains like the same loop with
accelerate + DDP + AdamW at stages 0-3 and resumes exactly; what accelerate or the plain HF
Trainer would wrap in DDP is refused with a sentence naming the fix.

One 2-rank launch trains everything (the `trained` fixture); the tests read its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

pytest.importorskip("accelerate")

from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from safetensors.torch import load_file

from optim import ZeroOptimizer
from optim.integrations import accelerate as zero_accelerate
from optim.policies import Communication
from parallel import accounting
from tests.dist_utils import run_distributed
from tests.models import make_model, no_decay_groups

pytestmark = pytest.mark.slow

WORLD, MICRO, ACCUM, EPOCHS = 2, 2, 2, 2
STEPS_PER_EPOCH = 5
SAMPLES = STEPS_PER_EPOCH * WORLD * ACCUM * MICRO
SEQ, VOCAB, LR, CLIP = 8, 37, 3e-3, 6.3  # the norms are about 5.7-7: some steps clipped, some not
# several buckets, every unit gathered
SMALL = {"communication": Communication(bucket_numel=1500, unit_numel=500, resident_numel=0)}
RTOL, ATOL = 1e-5, 1e-6


class Tokens(Dataset):
    """SAMPLES fixed token sequences: (index, inputs, targets)."""

    def __init__(self) -> None:
        self.data = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.data[i, :-1], self.data[i, 1:]


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def accelerator() -> Accelerator:
    """A fresh Accelerator on the CPU (gloo, from the test launch's torchrun variables), with a
    seeded sampler so that an epoch's order depends only on its number."""
    return Accelerator(
        cpu=True,
        gradient_accumulation_steps=ACCUM,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )


def train(method: str, root: Path, stage: int = 0, resume_from: Path | None = None) -> dict[str, Any]:
    """accelerate's documented loop, with DDP + AdamW ("ddp") or a ZeroOptimizer at `stage`
    through optim.integrations.accelerate.prepare ("zero"); saves its state after epoch 0, or
    starts from `resume_from` at epoch 1. Returns what it saw and ended with."""
    acc = accelerator()
    set_seed(0)
    model = make_model(n_blocks=2)
    loader = DataLoader(Tokens(), batch_size=MICRO, shuffle=True)
    if method == "ddp":
        opt = torch.optim.AdamW(no_decay_groups(model), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    else:
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, param_groups=no_decay_groups(model), lr=LR, **SMALL)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        model, opt, loader, sched = zero_accelerate.prepare(acc, model, opt, loader, sched)
    out: dict[str, Any] = {"losses": [], "norms": [], "seen": [], "wrapped": type(model).__name__}
    first = 0
    if resume_from is not None:
        acc.load_state(str(resume_from))
        out["loaded"] = _snapshot(model, opt, sched)
        first = 1
    with accounting.tracking() as log:
        for epoch in range(first, EPOCHS):
            loader.set_epoch(epoch)
            for ids, idx, tgt in loader:
                with acc.accumulate(model):
                    loss = model(idx, tgt)
                    acc.backward(loss)
                    if acc.sync_gradients:
                        out["norms"].append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                out["losses"].append(loss.item())
                out["seen"].append(ids.tolist())
            if epoch == 0 and resume_from is None and method == "zero":
                acc.save_state(str(root / "ckpt"))
                out["saved"] = _snapshot(model, opt, sched)
    out.update(_snapshot(model, opt, sched))
    if method == "zero" and resume_from is None:
        acc.save_model(model, str(root / "model"))
    if method == "zero":
        out["reductions"] = log.calls(op="reduce_scatter_tensor") / len(opt.optimizer.buckets)
    return out


def _snapshot(model: torch.nn.Module, opt: Any, sched: Any) -> dict[str, Any]:
    """The full weights, the whole optimizer state (ZeroOptimizer only) and the LRs."""
    zero = getattr(opt, "optimizer", None)
    if isinstance(zero, ZeroOptimizer):
        return {
            "weights": zero.full_state_dict(),
            "state": zero_accelerate.whole_state_dict(zero),
            "lr": sched.get_last_lr(),
        }
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {"weights": {k: v.detach().clone() for k, v in inner.state_dict().items()}, "lr": sched.get_last_lr()}


def train_everything(root: str) -> dict[str, Any]:
    """On each rank: the DDP run, then stages 0-3 (each saving after epoch 0) and each stage
    resumed from its checkpoint."""
    out: dict[str, Any] = {"ddp": train("ddp", Path(root) / "ddp")}
    for stage in range(4):
        out[stage] = train("zero", Path(root) / f"stage{stage}", stage)
    for stage in range(4):
        out[("resumed", stage)] = train(
            "zero", Path(root) / f"resumed{stage}", stage, Path(root) / f"stage{stage}" / "ckpt"
        )
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("accelerate")
    return root, run_distributed(train_everything, WORLD, str(root), timeout=300)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_accelerate_ddp_adamw(trained, stage: int) -> None:
    """Accumulation 2 under accelerator.accumulate, clipping at CLIP by accelerator.clip_grad_norm_,
    weight-decay groups, a warmup: every rank's micro-batch losses, the clipping norms and the
    final weights equal accelerate + DDP + AdamW's; the model is not wrapped, and the
    gradients are reduced once per optimizer step (the micro-steps before it ran under no_sync)."""
    _, ranks = trained
    for rank in ranks:
        ours, ddp = rank[stage], rank["ddp"]
        assert ours["seen"] == ddp["seen"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(ddp["norms"]), rtol=RTOL, atol=0)
        assert ours["weights"].keys() == ddp["weights"].keys()
        for name, want in ddp["weights"].items():
            torch.testing.assert_close(ours["weights"][name], want, rtol=RTOL, atol=ATOL, msg=name)
        assert ours["lr"] == ddp["lr"]
        assert ours["wrapped"] == "TinyLM" and ddp["wrapped"] == "DistributedDataParallel"
        if stage > 0:  # stage 0 all-reduces, and its count mixes in the clipping's
            assert ours["reductions"] == EPOCHS * STEPS_PER_EPOCH
    assert min(ranks[0]["ddp"]["norms"]) < CLIP < max(ranks[0]["ddp"]["norms"])  # clipping is exercised


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_load_state_resumes_exactly(trained, stage: int) -> None:
    """accelerator.load_state into a freshly prepared model and ZeroOptimizer gives bitwise the
    weights, optimizer state (fp32 masters included) and LR saved after epoch 0; epoch 1 then
    sees the same batches, has the same losses and ends with bitwise the same weights, state
    and LR as the uninterrupted run."""
    _, ranks = trained
    for rank in ranks:
        whole, resumed = rank[stage], rank[("resumed", stage)]
        _assert_equal(resumed["loaded"], whole["saved"])
        half = len(whole["seen"]) // 2
        assert resumed["seen"] == whole["seen"][half:]
        assert resumed["losses"] == whole["losses"][half:]
        assert resumed["norms"] == whole["norms"][len(whole["norms"]) // 2 :]
        _assert_equal(resumed, whole)


def _assert_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bitwise the same weights, whole optimizer state and LRs."""
    assert got["lr"] == want["lr"]
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), name
    for name, tensor in want["state"]["params"].items():
        assert torch.equal(got["state"]["params"][name], tensor), name
    for name, entries in want["state"]["state"].items():
        for key, tensor in entries.items():
            assert torch.equal(got["state"]["state"][name][key], tensor), f"{name}.{key}"
    assert got["state"]["param_groups"] == want["state"]["param_groups"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_saved_model_files_hold_every_weight(trained, stage: int) -> None:
    """save_state's model.safetensors (the fp32 masters at the save) and save_model's (the
    weights at the end) hold every weight at full shape, the tied head once: accelerate keeps
    one tensor per storage, and the model's own state_dict entries are no longer views of the
    optimizer's flat buffers."""
    root, ranks = trained
    for path, full in [
        (root / f"stage{stage}" / "ckpt" / "model.safetensors", ranks[0][stage]["saved"]["weights"]),
        (root / f"stage{stage}" / "model" / "model.safetensors", ranks[0][stage]["weights"]),
    ]:
        saved = load_file(str(path))
        assert set(full) - set(saved) == {"head.weight"}, path
        for name, tensor in saved.items():
            assert torch.equal(tensor, full[name]), f"{path}: {name}"


def load_whole(path: str, stage: int) -> dict[str, Any]:
    """A whole optimizer state file loaded into a ZeroOptimizer at `stage` on this launch's
    ranks; the whole state it then holds, and the file's."""
    model = make_model(n_blocks=2)
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, param_groups=no_decay_groups(model), lr=LR, **SMALL)
    saved = torch.load(path, weights_only=True)
    zero.load_state_dict(saved)
    return {"loaded": {"state": zero_accelerate.whole_state_dict(zero)}, "saved": {"state": saved}}


@pytest.mark.parametrize("world, stage", [(1, 3), (WORLD, 3)])
def test_saved_optimizer_loads_at_any_stage_and_size(trained, world: int, stage: int) -> None:
    """The optimizer file save_state wrote at stage 1 on 2 ranks (the whole state: fp32 masters,
    moments, steps, groups) loads into a ZeroOptimizer at stage 3 on 1 or 2 ranks bitwise."""
    root, _ = trained
    path = str(root / "stage1" / "ckpt" / "optimizer.bin")
    for rank in run_distributed(load_whole, world, path, stage, timeout=60):
        want = rank["saved"]["state"]
        for name, entries in want["state"].items():
            for key, tensor in entries.items():
                assert torch.equal(rank["loaded"]["state"]["state"][name][key], tensor), f"{name}.{key}"
        for name, tensor in want["params"].items():
            assert torch.equal(rank["loaded"]["state"]["params"][name], tensor), name


# ---- what accelerate and the plain HF Trainer would wrap in DDP ---------------------------------
def plain_prepare(stage: int) -> str:
    """accelerate's own prepare of a model and its ZeroOptimizer (the optimizer state moved to
    accelerate's device), then a forward: the error."""
    acc = accelerator()
    model = make_model(n_blocks=2)
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=LR, **SMALL)
    model, opt = acc.prepare(model, opt)
    data = Tokens().data
    try:
        model(data[:2, :-1], data[:2, 1:])
    except RuntimeError as e:
        return str(e)
    return "no error"


def plain_trainer(stage: int, root: str) -> str:
    """transformers.Trainer given optimizers=(ZeroOptimizer, scheduler): the error of train()."""
    from transformers import Trainer

    from tests.test_integration_hf import ZERO_KWARGS, dataset, gpt2, training_args

    model = gpt2()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=LR, **ZERO_KWARGS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    trainer = Trainer(model=model, args=training_args(root), train_dataset=dataset(), optimizers=(opt, sched))
    try:
        trainer.train()
    except RuntimeError as e:
        return str(e)
    return "no error"


def moved_state_loads(stage: int) -> bool:
    """accelerate's device placement of the optimizer state (state_dict, every tensor .to
    accelerate's device "cpu:<rank>", load_state_dict) leaves it bitwise as it was."""
    acc = accelerator()
    model = make_model(n_blocks=2)
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=LR, **SMALL)
    data = Tokens().data
    model(data[:2, :-1], data[:2, 1:]).backward()
    zero.step()
    before = zero_accelerate.whole_state_dict(zero)
    acc.prepare_optimizer(zero)
    after = zero_accelerate.whole_state_dict(zero)
    return all(torch.equal(after["params"][k], v) for k, v in before["params"].items()) and all(
        torch.equal(after["state"][k][key], v) for k, e in before["state"].items() for key, v in e.items()
    )


def wrapped_everywhere(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in range(4):
        out[("prepare", stage)] = plain_prepare(stage)
        out[("trainer", stage)] = plain_trainer(stage, os.path.join(root, f"trainer{stage}"))
        out[("moved", stage)] = moved_state_loads(stage)
    return out


def test_wrapping_frameworks_name_their_fix(tmp_path: Path) -> None:
    """At every stage, accelerator.prepare(model, ZeroOptimizer) (which now gets past its device
    placement of the optimizer state, unchanged) and the plain HF Trainer with
    optimizers=(ZeroOptimizer, scheduler) wrap the model in DDP; its first forward raises one
    sentence naming the wrapper and the one-line fix, on every rank, before any step."""
    for rank in run_distributed(wrapped_everywhere, WORLD, str(tmp_path), timeout=300):
        for stage in range(4):
            prepared, trainer = rank[("prepare", stage)], rank[("trainer", stage)]
            assert prepared.startswith("accelerator.prepare() wrapped the model in DistributedDataParallel"), prepared
            assert "optim.integrations.accelerate.prepare(accelerator, model, optimizer, ...)" in prepared
            assert trainer.startswith("the Hugging Face Trainer wrapped the model in DistributedDataParallel"), trainer
            assert f"optim.integrations.hf.ZeroTrainer(model=..., args=..., zero_stage={stage})" in trainer
            for message in (prepared, trainer):
                assert ". " not in message and "\n" not in message, message
            assert rank[("moved", stage)]


# ---- what prepare refuses -----------------------------------------------------------------------
class FakeAccelerator:
    """The attributes prepare reads before it prepares anything."""

    def __init__(self, distributed_type: str = "MULTI_CPU", mixed_precision: str = "no", device: str = "cpu") -> None:
        from accelerate.utils import DistributedType

        self.distributed_type = DistributedType[distributed_type]
        self.mixed_precision = mixed_precision
        self.device = torch.device(device)
        self._optimizers: list = []


def bf16_steps() -> dict[str, Any]:
    """Two steps at stage 3 under Accelerator(mixed_precision="bf16"): the autocast dtype the
    forward ran under, and whether the weights changed and stayed finite."""
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = make_model(n_blocks=2)
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=LR, **SMALL)
    before = zero.full_state_dict()
    model, opt = zero_accelerate.prepare(acc, model, zero)
    seen = []
    model.blocks[0].register_forward_pre_hook(  # inside the model's forward, which accelerate wrapped
        lambda m, a: seen.append(str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else "off")
    )
    data = Tokens().data
    for _ in range(2):
        acc.backward(model(data[:2, :-1], data[:2, 1:]))
        opt.step()
        opt.zero_grad()
    after = zero.full_state_dict()
    return {
        "autocast": seen,
        "changed": not torch.equal(after["emb.weight"], before["emb.weight"]),
        "finite": all(v.isfinite().all() for v in after.values() if v.is_floating_point()),
    }


def test_bf16_mixed_precision() -> None:
    """accelerate's mixed_precision="bf16" runs the forward under bf16 autocast and trains."""
    out = run_distributed(bf16_steps, 1, timeout=60)[0]
    assert out["autocast"] == ["torch.bfloat16"] * 2
    assert out["changed"] and out["finite"]


def refusals() -> list[str]:
    model = make_model(n_blocks=2)
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=LR)
    cases = [
        FakeAccelerator("DEEPSPEED"),
        FakeAccelerator("FSDP"),
        FakeAccelerator(mixed_precision="fp16"),
        FakeAccelerator(device="cuda:0"),
    ]
    messages = []
    for fake in cases:
        with pytest.raises(ValueError) as error:
            zero_accelerate.prepare(fake, model, zero)
        messages.append(str(error.value))
    return messages


def test_prepare_refuses_what_it_cannot_train() -> None:
    """DeepSpeed or FSDP in the accelerate config, fp16 mixed precision and a model on another
    device than accelerator.device each raise one sentence before anything is prepared."""
    messages = run_distributed(refusals, 1, timeout=60)[0]
    expected = [
        "accelerate runs DEEPSPEED, which shards or places the model itself",
        "accelerate runs FSDP, which shards or places the model itself",
        "accelerate's mixed_precision='fp16' needs its gradient scaler",
        "the model's parameters are on cpu but accelerator.device is cuda:0",
    ]
    for message, start in zip(messages, expected, strict=True):
        assert message.startswith(start), message
        assert ". " not in message and "\n" not in message, message


def test_importing_optim_integrations_does_not_import_accelerate() -> None:
    """optim.integrations (whose DDP sentences name the adapters) imports no framework."""
    code = (
        "import sys, optim, optim.integrations; print(sorted({'accelerate', 'pytorch_lightning'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.bench
def test_benchmark_quick_run(tmp_path: Path) -> None:
    """`python -m experiments.bench.accelerate_loop --quick` runs, prints its tables, and every
    method trains the same thing (the final losses agree)."""
    out = tmp_path / "bench.json"
    methods = ["ddp", "zero1", "zero3", "plain3"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.bench.accelerate_loop",
            "--quick",
            "--methods",
            *methods,
            "--json",
            str(out),
        ],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    for row in ["| zero1 / ddp ", "| zero3 / ddp ", "| zero3 / plain3 "]:
        assert row in proc.stdout, proc.stdout
    results = json.loads(out.read_text())
    losses = [results["methods"][m]["final_loss"] for m in methods]
    assert max(losses) - min(losses) < 1e-5, losses
    goals = {(r["ours"], r["theirs"]): r["met"] is not None for r in results["ratios"]}
    assert goals == {("zero1", "ddp"): True, ("zero3", "ddp"): False, ("zero3", "plain3"): True}, goals
