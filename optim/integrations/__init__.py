"""Adapters that put ZeroOptimizer into other trainers: `lightning.ZeroStrategy` and
`hf.ZeroTrainer`. Each imports its framework lazily, so `optim` never requires it."""

from __future__ import annotations

from typing import Any

import torch

from optim.zero_setup import check_stage

# ZeroOptimizer's layout and precision options, which an adapter passes on; hyperparameters
# come from the trainer's own optimizer settings.
LAYOUT_OPTIONS = ("param_dtype", "reduce_dtype", "bucket_numel", "unit_numel", "resident_numel", "step_backend")


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
    if options.get("param_dtype") == torch.float16:
        raise ValueError(
            f"{options_name} param_dtype=torch.float16 needs a loss-scaled backward, which {adapter} does not run; "
            "use torch.bfloat16"
        )
