"""`ZeroStrategy`: Lightning Fabric's usual loop with `optim.ZeroOptimizer` (ZeRO stages 0-3)
in place of DDP. The stage and every option stay on the ZeroOptimizer, built over the model
once it is on its device:

    fabric = Fabric(accelerator="cuda", devices=8, strategy=ZeroStrategy())
    fabric.launch()
    model = MyModel().to(fabric.device)                 # or built under fabric.init_module()
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=3e-4, weight_decay=0.1)
    model, opt = fabric.setup(model, opt)
    for i, batch in enumerate(loader):
        with fabric.no_backward_sync(model, enabled=(i + 1) % accum != 0):
            fabric.backward(model(batch) / accum)
        if (i + 1) % accum == 0:
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
    fabric.save("ckpt", {"model": model, "optimizer": opt, "step": step})
    fabric.load("ckpt", {"model": model, "optimizer": opt})     # any world size, any stage

What the strategy does in place of Fabric's DDP strategy (launch, process groups, collectives
and the device are DDP's):
- the model is not wrapped: ZeroOptimizer reduces gradients itself; a model whose parameters a
  ZeroOptimizer holds on another device is refused instead of moved (which would detach them);
- `fabric.no_backward_sync(model)` is the model's ZeroOptimizer's `no_sync()`;
- `fabric.clip_gradients(model, opt, max_norm=...)` is `ZeroOptimizer.clip_grad_norm_`: the
  global norm over every rank and shard (model-parallel and expert parameters counted once);
  clipping by value is refused;
- `fabric.save` / `fabric.load`, as Fabric's FSDP strategy, write and read either a sharded
  folder (`state_dict_type="sharded"`, the default: `optim.integrations.checkpoint_folder`) or
  one consolidated file from rank 0 (`"full"`: the module's full weights, from the fp32
  masters, and each optimizer's `torch.optim` state, `ZeroOptimizer.consolidate_state_dict`).
  Both load at any world size and stage; `fabric.load` tells them apart and also reads the
  file Fabric's DDP strategy writes of a ZeroOptimizer.

Precision: "32-true" or "bf16-mixed" (autocast); bf16 compute weights with fp32 masters are
`ZeroOptimizer(precision=optim.policies.MixedPrecision(torch.bfloat16))`. Imports Lightning
Fabric (`lightning_fabric`, else `lightning.fabric`) at import time: `optim` itself never
imports this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.constants import default_pg_timeout

from optim.integrations import checkpoint_folder
from optim.zero import ZeroOptimizer
from optim.zero_setup import claimed

try:
    import lightning_fabric as lf
except ImportError:
    try:
        import lightning.fabric as lf  # the unified "lightning" package
    except ImportError:
        raise ImportError("optim.integrations.fabric needs Lightning Fabric; pip install lightning-fabric") from None

__all__ = ["ZeroStrategy"]

CLIP_BY_VALUE = (
    "ZeroStrategy clips gradients only by their global norm (ZeroOptimizer.clip_grad_norm_); "
    "call fabric.clip_gradients(model, optimizer, max_norm=...)"
)
NOT_ZERO = (
    "ZeroStrategy trains with the ZeroOptimizer you build over the model, not a {kind}: "
    "model.to(fabric.device), then ZeroOptimizer(model, torch.optim.AdamW, stage=..., lr=...), then fabric.setup(model, optimizer)"
)


class ZeroStrategy(lf.strategies.DDPStrategy):
    """Data parallelism through `optim.ZeroOptimizer` for Lightning Fabric (module docstring).
    Arguments are Fabric's DDP strategy's, plus `state_dict_type`: "sharded" (a folder of
    shards, the default) or "full" (one consolidated file) for `fabric.save`."""

    def __init__(
        self,
        *,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        cluster_environment: Any = None,
        precision: lf.plugins.Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"state_dict_type must be 'sharded' or 'full', not {state_dict_type!r}")
        super().__init__(
            cluster_environment=cluster_environment,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.state_dict_type = state_dict_type
        self._backward_sync_control = _ZeroBackwardSync(self)
        self.zero_optimizers: list[ZeroOptimizer] = []  # set up through this strategy

    # ---- precision --------------------------------------------------------------------------
    @property
    def precision(self) -> lf.plugins.Precision:
        return self._precision if self._precision is not None else lf.plugins.Precision()

    @precision.setter
    def precision(self, precision: lf.plugins.Precision | None) -> None:
        supported = type(precision) is lf.plugins.Precision or (
            type(precision) is lf.plugins.MixedPrecision and precision.precision == "bf16-mixed"
        )
        if precision is not None and not supported:
            raise ValueError(
                f"ZeroStrategy supports precision '32-true' or 'bf16-mixed', not {getattr(precision, 'precision', type(precision).__name__)!r}; "
                "for bf16 weights with fp32 master copies build ZeroOptimizer(precision=optim.policies.MixedPrecision(torch.bfloat16))"
            )
        self._precision = precision

    # ---- setup -------------------------------------------------------------------------------
    def module_to_device(self, module: torch.nn.Module) -> None:
        """Move the module, unless a ZeroOptimizer holds its parameters: they are checked to be
        on the device already, since moving them would detach them from its buffers."""
        if not claimed(module):
            super().module_to_device(module)
            return
        device = self.root_device
        for name, p in module.named_parameters():
            if p.device.type != device.type or (device.type != "cpu" and p.device.index != device.index):
                raise ValueError(
                    f"parameter {name!r} is on {p.device} but fabric.device is {device}, and a ZeroOptimizer holds it; "
                    "move the model with model.to(fabric.device) (or build it under fabric.init_module()) before "
                    "building ZeroOptimizer"
                )

    def setup_module_and_optimizers(
        self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], Any]:
        """The module as it is (no DDP) and its ZeroOptimizers, which must be built over it."""
        for opt in optimizers:
            if isinstance(opt, ZeroOptimizer) and opt.model is not module:
                raise ValueError(
                    "fabric.setup got a ZeroOptimizer built over another module; build it over the model you set up "
                    "(ZeroOptimizer(model, ...) with the same model as fabric.setup(model, optimizer))"
                )
        return module, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError(NOT_ZERO.format(kind=type(optimizer).__name__))
        if optimizer not in self.zero_optimizers:
            self.zero_optimizers.append(optimizer)
        return optimizer

    def zero_optimizer_of(self, module: torch.nn.Module) -> ZeroOptimizer:
        """The ZeroOptimizer set up over `module`."""
        for opt in self.zero_optimizers:
            if opt.model is module:
                return opt
        raise ValueError(
            "no ZeroOptimizer over this model was set up; call fabric.setup(model, optimizer) with the "
            "ZeroOptimizer built over it"
        )

    # ---- training ----------------------------------------------------------------------------
    def clip_gradients_norm(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """`ZeroOptimizer.clip_grad_norm_`: the global L2 norm over every rank and shard."""
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError(NOT_ZERO.format(kind=type(optimizer).__name__))
        norm = optimizer.clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"the total norm of the gradients is {float(norm)}, so they cannot be clipped; pass "
                "error_if_nonfinite=False to fabric.clip_gradients to skip this check"
            )
        return norm

    def clip_gradients_value(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_val: float | int
    ) -> None:
        raise ValueError(CLIP_BY_VALUE)

    # ---- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """A sharded folder or one consolidated file (`state_dict_type`, module docstring). A
        collective: every rank calls it."""
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy saves through torch.distributed.checkpoint and takes no storage_options; drop them"
            )
        path = Path(self.broadcast(str(path)))
        if self.state_dict_type == "full":
            self._save_file(path, state, filter or {})
            return
        if filter:
            raise ValueError(
                "a sharded checkpoint cannot be filtered, since every shard loads whole; drop filter= or use "
                "ZeroStrategy(state_dict_type='full')"
            )
        if self.is_global_zero and path.is_file():
            path.unlink()
        self.barrier()
        path.mkdir(parents=True, exist_ok=True)
        tensors, meta = {}, {}
        saved_modules = [obj for obj in state.values() if isinstance(obj, torch.nn.Module)]
        for key, obj in state.items():
            if isinstance(obj, torch.nn.Module):
                tensors[key] = checkpoint_folder.module_entries(obj, self._zero_of_module(obj))
            elif isinstance(obj, torch.optim.Optimizer):
                zero = self._checked(obj)
                tensors[key] = checkpoint_folder.optimizer_entries(zero.state_dict(), zero.model not in saved_modules)
            else:
                meta[key] = _state_of(obj)
        dcp.save(tensors, checkpoint_id=path)
        if self.is_global_zero:
            torch.save(meta, path / checkpoint_folder.META)

    def _save_file(self, path: Path, state: dict[str, Any], filter: dict[str, Callable[[str, Any], bool]]) -> None:
        """Rank 0 writes one torch.save file: modules' full weights, optimizers' torch.optim state."""
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory; a full checkpoint is one file, so pass another path")
        full: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, torch.nn.Module):
                zero = self._zero_of_module(obj)
                converted = zero.full_state_dict() if zero is not None else obj.state_dict()
            elif isinstance(obj, torch.optim.Optimizer):
                zero = self._checked(obj)
                zero.consolidate_state_dict(to=0)
                converted = zero.state_dict() if zero.rank == 0 else None
            else:
                converted = _state_of(obj)
            if key in filter and isinstance(converted, dict):
                converted = {k: v for k, v in converted.items() if filter[key](k, v)}
            full[key] = converted
        if self.is_global_zero:
            torch.save(full, path)

    def load_checkpoint(
        self,
        path: str | Path,
        state: torch.nn.Module | torch.optim.Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore `state`'s objects from a sharded folder or a consolidated file, saved under
        any world size and stage; returns what `state` did not ask for. A collective."""
        path = Path(self.broadcast(str(path)))
        if checkpoint_folder.is_folder(path):
            if not isinstance(state, dict) or not state:
                raise ValueError(
                    f"{path} is a sharded checkpoint, which loads into objects: pass "
                    "state={'model': model, 'optimizer': optimizer, ...} to fabric.load"
                )
            return self._load_folder(path, state, strict, weights_only)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is neither a checkpoint file nor a ZeroStrategy checkpoint folder")
        checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
        if not state:
            return checkpoint
        if isinstance(state, torch.nn.Module):  # fabric.load_raw
            state.load_state_dict(checkpoint, strict=strict)
            return {}
        if isinstance(state, torch.optim.Optimizer):
            state.load_state_dict(checkpoint)
            return {}
        _check_keys(state, checkpoint.keys(), strict)
        for key, obj in state.items():
            if key not in checkpoint:
                continue
            if isinstance(obj, torch.nn.Module):
                obj.load_state_dict(checkpoint.pop(key), strict=strict)
            elif _is_stateful(obj):
                obj.load_state_dict(checkpoint.pop(key))
            else:
                state[key] = checkpoint.pop(key)
        return checkpoint

    def _load_folder(
        self, path: Path, state: dict[str, Any], strict: bool, weights_only: bool | None
    ) -> dict[str, Any]:
        """Modules and optimizers from the folder's shards (one dcp.load), the rest from META."""
        meta = torch.load(path / checkpoint_folder.META, weights_only=weights_only)
        names = checkpoint_folder.saved_keys(path)
        saved = {name.split(".", 1)[0] for name in names}
        _check_keys(state, saved | set(meta), strict)
        tensors: dict[str, Any] = {}
        loaded: dict[ZeroOptimizer, tuple[dict[str, Any], str | None]] = {}  # its state dict, its key in tensors
        for key, obj in state.items():
            if key in saved and isinstance(obj, torch.nn.Module):
                zero = self._zero_of_module(obj)
                tensors[key] = checkpoint_folder.module_entries(obj, zero)  # the masters' views: loads them
                if zero is not None:
                    loaded.setdefault(zero, (zero.state_dict(), None))
            elif key in saved and isinstance(obj, torch.optim.Optimizer):
                zero = self._checked(obj)
                sd = zero.state_dict()
                with_masters = any(name.startswith(f"{key}.params.") for name in names)
                tensors[key] = checkpoint_folder.optimizer_entries(sd, with_masters)
                loaded[zero] = (sd, key)
        dcp.load(tensors, checkpoint_id=path)
        for zero, (sd, key) in loaded.items():
            checkpoint_folder.load_into(zero, sd, tensors[key] if key is not None else None)
        for key, obj in state.items():
            if key in meta:
                if _is_stateful(obj):
                    obj.load_state_dict(meta.pop(key))
                else:
                    state[key] = meta.pop(key)
        return meta

    def _zero_of_module(self, module: torch.nn.Module) -> ZeroOptimizer | None:
        return next((opt for opt in self.zero_optimizers if opt.model is module), None)

    def _checked(self, optimizer: torch.optim.Optimizer) -> ZeroOptimizer:
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError(NOT_ZERO.format(kind=type(optimizer).__name__))
        return optimizer


class _ZeroBackwardSync(lf.strategies.strategy._BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: the model's ZeroOptimizer's `no_sync()`."""

    def __init__(self, strategy: ZeroStrategy) -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        return self.strategy.zero_optimizer_of(module).no_sync()


# ---- helpers ----------------------------------------------------------------------------------
def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _state_of(obj: Any) -> Any:
    """What a checkpoint keeps of an object that is neither a module nor an optimizer."""
    return obj.state_dict() if _is_stateful(obj) else obj


def _check_keys(state: dict[str, Any], saved: Any, strict: bool) -> None:
    """Fabric's strict loading: every key asked for is in the checkpoint."""
    missing = [k for k in state if k not in saved]
    if strict and missing:
        raise KeyError(
            f"the checkpoint has no {missing[0]!r}, which the state to load asks for; pass strict=False to load the rest"
        )
