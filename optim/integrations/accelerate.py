"""`prepare`: Hugging Face accelerate's `Accelerator.prepare` for a loop whose optimizer is a
ZeroOptimizer (ZeRO stages 0-3). accelerate's documented loop stays as it is; one line changes:

    model = MyModel().to(accelerator.device)  # on its device before the optimizer is built
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    model, opt, loader, sched = optim.integrations.accelerate.prepare(accelerator, model, opt, loader, sched)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    accelerator.save_state("ckpt")  # every rank; accelerator.load_state("ckpt") resumes exactly

What `accelerator.prepare` would do, and what this does instead:

    accelerator.prepare                      prepare
    model: moved, wrapped in DDP             not moved, not wrapped (ZeroOptimizer reduces the
                                             gradients; at stage 3 the parameters are empty between
                                             uses): autocast only, under mixed_precision="bf16"
    accumulate(model): DDP's no_sync         ZeroOptimizer.no_sync (the model's `no_sync`)
    optimizer state moved to the device      left where its shards are
    save_state: rank 0 saves                 the whole optimizer state (fp32 masters included),
    optimizer.state_dict()                   gathered by a collective state_dict(), which loads
                                             at any stage and data-parallel size
    save_state: model.state_dict()           the full weights from the fp32 masters
                                             (`ZeroOptimizer.full_state_dict`), which load_state
                                             loads into the model and its masters

Data loaders, schedulers and everything else go through `accelerator.prepare`.
`accelerator.clip_grad_norm_(model.parameters(), max_norm)` clips by the global norm as it is
(torch's clip_grad_norm_ on ZeroOptimizer's `.grad` placeholders). Imports accelerate at
import time: `optim` itself never imports this module.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from optim import sharded_state
from optim.zero import ZeroOptimizer

__all__ = ["ZeroAcceleratedOptimizer", "prepare", "whole_state_dict"]

# accelerate modes that shard or place the model themselves
SHARDING_TYPES = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA)
_HOOKED: weakref.WeakSet[Accelerator] = weakref.WeakSet()  # accelerators whose save_state writes full weights


def prepare(accelerator: Accelerator, *objects: Any) -> Any:
    """`accelerator.prepare(*objects)` for objects among which are ZeroOptimizers and their
    models (see the module docstring); returns them prepared, in the same order (one object
    alone, as accelerate does). Every rank calls it."""
    _check_accelerator(accelerator)
    prepared: list[Any] = list(objects)
    rest = []
    for i, obj in enumerate(objects):  # optimizers first: their devices are checked before anything is prepared
        if isinstance(obj, ZeroOptimizer):
            prepared[i] = _prepare_optimizer(accelerator, obj)
    for i, obj in enumerate(objects):
        if isinstance(obj, ZeroOptimizer):
            continue
        if isinstance(obj, torch.nn.parallel.DistributedDataParallel) and ZeroOptimizer.of(obj.module) is not None:
            raise ValueError(
                "this model was already wrapped in DistributedDataParallel (by accelerator.prepare); pass the bare "
                "model to optim.integrations.accelerate.prepare in place of accelerator.prepare"
            )
        zero = ZeroOptimizer.of(obj) if isinstance(obj, torch.nn.Module) else None
        if zero is not None:
            prepared[i] = _prepare_model(accelerator, obj, zero)
        else:
            rest.append(i)
    if rest:  # after the optimizers, so that accelerate finds a scheduler's optimizer
        done = accelerator.prepare(*(objects[i] for i in rest))
        for i, obj in zip(rest, done if len(rest) > 1 else (done,)):
            prepared[i] = obj
    if accelerator not in _HOOKED:
        accelerator.register_save_state_pre_hook(_save_full_weights)
        _HOOKED.add(accelerator)
    return prepared[0] if len(prepared) == 1 else tuple(prepared)


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper around a ZeroOptimizer: its state stays where the shards
    are (no device placement), and `state_dict()` is the whole state on every rank (a
    collective, which accelerate's save_state runs on every rank before rank 0 writes it);
    `load_state_dict` takes that or any state dict ZeroOptimizer loads."""

    optimizer: ZeroOptimizer

    def __init__(self, optimizer: ZeroOptimizer) -> None:
        super().__init__(optimizer, device_placement=False)

    def state_dict(self) -> dict[str, Any]:
        return whole_state_dict(self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def whole_state_dict(zero: ZeroOptimizer) -> dict[str, Any]:
    """`zero.state_dict()` with every sharded tensor gathered whole: the same plain dict on
    every rank, which `ZeroOptimizer.load_state_dict` loads at any stage and data-parallel
    size. A collective: every rank must call it."""

    def whole(value: Any) -> Any:
        if hasattr(value, "local_shards"):
            return sharded_state.full_tensor(value, zero.group)
        return value.clone() if isinstance(value, torch.Tensor) else value

    sd = zero.state_dict()
    out: dict[str, Any] = {
        "params": {name: whole(v) for name, v in sd["params"].items()},
        "state": {name: {key: whole(v) for key, v in entries.items()} for name, entries in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }
    if "loss_scaler" in sd:
        out["loss_scaler"] = sd["loss_scaler"]
    return out


# ---- helpers ----------------------------------------------------------------------------------
def _check_accelerator(accelerator: Accelerator) -> None:
    """Accelerator settings ZeroOptimizer cannot train under, refused before anything is prepared."""
    if accelerator.distributed_type in SHARDING_TYPES:
        raise ValueError(
            f"accelerate runs {accelerator.distributed_type.value}, which shards or places the model itself; turn it "
            "off in the accelerate config and choose the sharding with ZeroOptimizer(stage=...)"
        )
    if accelerator.mixed_precision not in ("no", "bf16"):
        raise ValueError(
            f"accelerate's mixed_precision={accelerator.mixed_precision!r} needs its gradient scaler, which cannot see "
            "ZeroOptimizer's gradients; use mixed_precision='bf16' (or ZeroOptimizer(precision=optim.policies.MixedPrecision(torch.bfloat16)))"
        )


def _check_device(accelerator: Accelerator, zero: ZeroOptimizer) -> None:
    """The optimizer's buffers are on accelerator.device (any index of the CPU)."""
    device = zero.param_groups[0]["params"][0].device
    target = accelerator.device
    if device.type != target.type or (device.type != "cpu" and device.index != target.index):
        raise ValueError(
            f"the model's parameters are on {device} but accelerator.device is {target}; move the model with "
            "model.to(accelerator.device) before building ZeroOptimizer, which takes the parameters into its buffers"
        )


def _prepare_optimizer(accelerator: Accelerator, zero: ZeroOptimizer) -> ZeroAcceleratedOptimizer:
    """The wrapper accelerate's loop steps, registered for save_state / load_state."""
    for wrapped in accelerator._optimizers:
        if wrapped.optimizer is zero:
            return wrapped
    _check_device(accelerator, zero)
    zero.model.no_sync = zero.no_sync
    wrapped = ZeroAcceleratedOptimizer(zero)
    wrapped._is_accelerate_prepared = True
    accelerator._optimizers.append(wrapped)
    return wrapped


def _prepare_model(accelerator: Accelerator, model: torch.nn.Module, zero: ZeroOptimizer) -> torch.nn.Module:
    """The model as accelerate prepares one for evaluation (autocast, no DDP, not moved), whose
    `no_sync` (what `accelerator.accumulate` and `accelerator.no_sync` enter) is the optimizer's."""
    if model in accelerator._models:
        return model
    _check_device(accelerator, zero)
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    model.no_sync = zero.no_sync
    model._is_accelerate_prepared = True
    return model


def _save_full_weights(models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
    """save_state's hook (every rank): a ZeroOptimizer's model is saved as its full weights
    from the fp32 masters, in their original dtypes (the model's own may be bf16 copies)."""
    for i, model in enumerate(models):
        zero = ZeroOptimizer.of(model)
        if zero is not None:
            weights[i] = OrderedDict(zero.full_state_dict())
