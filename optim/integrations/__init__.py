"""Adapters that put ZeroOptimizer into other trainers: `lightning.ZeroStrategy`,
`fabric.ZeroStrategy`, `hf.ZeroTrainer` and `accelerate.prepare`. Each imports its framework lazily, so `optim` never
requires it. `wrapped_by` and WRAPPED_BY name the adapter to a user whose framework wrapped the
model in DDP (ZeroOptimizer's model check raises that sentence)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from optim.policies import MixedPrecision
from optim.zero_setup import check_stage

# ZeroOptimizer's options (optim.policies) an adapter passes on; hyperparameters come from the
# trainer's own optimizer settings, the groups from its launcher.
ZERO_OPTIONS = ("precision", "communication", "zero_plus_plus", "step_backend")


def check_zero_options(
    stage: Any, options: dict[str, Any], allowed: tuple[str, ...], *, names: tuple[str, str, str], instead: str
) -> None:
    """An adapter's ZeRO stage and ZeroOptimizer options, checked before its trainer starts
    anything. `names`: the adapter, its stage argument and its options argument; `instead`:
    where optimizer hyperparameters go instead."""
    adapter, stage_name, options_name = names
    check_stage(stage, stage_name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"{options_name} {unknown} are not options {adapter} passes to ZeroOptimizer ({', '.join(allowed)}); "
            f"optimizer hyperparameters go to {instead}"
        )
    precision = options.get("precision")
    if precision is not None and not isinstance(precision, MixedPrecision):
        raise TypeError(f"{options_name} precision= must be an optim.policies.MixedPrecision, got {precision!r}")
    if precision is not None and precision.param_dtype == torch.float16:
        raise ValueError(
            f"{options_name} precision param_dtype=torch.float16 needs a loss-scaled backward, which {adapter} does "
            "not run; use torch.bfloat16"
        )


# A model wrapped in DistributedDataParallel by a framework, which ZeroOptimizer refuses: what
# made the wrap, and the one-line fix in the framework's own terms ({stage}: the optimizer's).
WRAPPED_BY = {
    "accelerate": (
        "accelerator.prepare() wrapped the model in DistributedDataParallel, but ZeroOptimizer reduces gradients "
        "itself: prepare with optim.integrations.accelerate.prepare(accelerator, model, optimizer, ...) in place "
        "of accelerator.prepare(model, optimizer, ...)"
    ),
    "fabric": (
        "Fabric's DDP strategy wrapped the model in DistributedDataParallel, but ZeroOptimizer reduces gradients "
        "itself: launch with Fabric(strategy=optim.integrations.fabric.ZeroStrategy())"
    ),
    "lightning": (
        "Lightning's DDP strategy wrapped the LightningModule in DistributedDataParallel, but ZeroOptimizer reduces "
        "gradients itself: train with pl.Trainer(strategy=optim.integrations.lightning.ZeroStrategy(stage={stage}))"
    ),
    "transformers": (
        "the Hugging Face Trainer wrapped the model in DistributedDataParallel (through accelerate), but "
        "ZeroOptimizer reduces gradients itself: train with optim.integrations.hf.ZeroTrainer(model=..., args=..., "
        "zero_stage={stage}), which builds the ZeroOptimizer itself, in place of Trainer(optimizers=(ZeroOptimizer(...), ...))"
    ),
}


def wrapped_by(ddp: torch.nn.Module) -> str | None:
    """The framework that wrapped a model in the DistributedDataParallel `ddp` (a key of
    WRAPPED_BY), None for a wrap written by hand. Reads marks the frameworks leave (the
    Trainer's or Fabric's frames on the stack, accelerate's prepared flag, a LightningModule inside),
    importing none of them."""
    frame = sys._getframe()
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("transformers.trainer"):
            return "transformers"
        if module.startswith(("lightning_fabric.wrappers", "lightning.fabric.wrappers")):  # a _FabricModule's forward
            return "fabric"
        frame = frame.f_back
    if getattr(ddp, "_is_accelerate_prepared", False):
        return "accelerate"
    lightning = ("pytorch_lightning.", "lightning.")  # a LightningModule, or a wrapper of one
    if any(c.__module__.startswith(lightning) for c in type(getattr(ddp, "module", None)).__mro__):
        return "lightning"
    return None
