"""`ZeroStrategy`: train a LightningModule under PyTorch Lightning with `optim.ZeroOptimizer`
(ZeRO stages 0-3) instead of DDP.

    class Lit(pl.LightningModule):                      # an ordinary LightningModule
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": LambdaLR(opt, warmup), "interval": "step"}}

    trainer = pl.Trainer(strategy=ZeroStrategy(stage=3), accumulate_grad_batches=4, gradient_clip_val=1.0)
    trainer.fit(Lit())
    trainer.strategy.save_full_weights("weights.pt")    # every rank calls it

What the strategy does in place of DDP's:
- the module is not wrapped: ZeroOptimizer reduces gradients itself. It is moved to the
  device first, then the optimizer is built (which moves the parameters into flat buffers);
- the torch optimizer `configure_optimizers` returns is rebuilt as a ZeroOptimizer of the
  same class, param groups and hyperparameters, and its LR schedulers are re-pointed at it
  (a ZeroOptimizer over the LightningModule itself, at the strategy's stage, is taken as is);
- the steps run through the module's own call, so the stage-3 hooks on it gather its
  parameters (as FSDP's wrapper forward does);
- `accumulate_grad_batches` runs the non-final micro-batches under `ZeroOptimizer.no_sync()`;
  `gradient_clip_val` clips by `ZeroOptimizer.clip_grad_norm_` (`ZeroPrecision`);
- a checkpoint is a folder: a sharded torch.distributed.checkpoint of the module (trainable
  parameters as the fp32 masters) and of the optimizer, in ZeroOptimizer's canonical
  layout that loads at any world size and stage (or into a module with no optimizer), plus `meta.pt` with the rest of Lightning's checkpoint (loops, LR schedulers,
  callbacks), as FSDPStrategy's sharded checkpoints;
- `full_state_dict()` / `save_full_weights(path)` export the unsharded module weights (at
  stage 3 `module.state_dict()` holds empty tensors between uses).

Precision: "32-true" or "bf16-mixed" (autocast); bf16 compute weights with fp32 masters
are `ZeroStrategy(precision=optim.policies.MixedPrecision(torch.bfloat16))`. Imports Lightning (`pytorch_lightning`, else
`lightning.pytorch`) at import time: `optim` itself never imports this module.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.constants import default_pg_timeout

from optim.integrations import ZERO_OPTIONS, check_zero_options, checkpoint_folder
from optim.integrations.checkpoint_folder import META
from optim.zero import ZeroOptimizer

try:
    import pytorch_lightning as pl
except ImportError:
    try:
        import lightning.pytorch as pl  # the unified "lightning" package
    except ImportError:
        raise ImportError(
            "optim.integrations.lightning needs PyTorch Lightning; pip install pytorch-lightning"
        ) from None

__all__ = ["ZeroPrecision", "ZeroStrategy"]

CLIP_BY_VALUE = (
    "ZeroStrategy clips gradients only by their global norm (ZeroOptimizer.clip_grad_norm_); "
    "set gradient_clip_algorithm='norm'"
)
# LightningModules whose parameters a ZeroStrategy has handed to a ZeroOptimizer.
_SHARDED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


class ZeroPrecision(pl.plugins.precision.Precision):
    """Lightning precision plugin of ZeroStrategy: fp32 ("32-true") or bf16 autocast
    ("bf16-mixed"), clipping gradients by ZeroOptimizer's global norm: one all-reduce over
    the shards, where `torch.nn.utils.clip_grad_norm_` on the `.grad` placeholders would
    gather a norm per parameter."""

    def __init__(self, precision: Literal["32-true", "bf16-mixed"] = "32-true", device: str = "cpu") -> None:
        if precision not in ("32-true", "bf16-mixed"):
            raise ValueError(f"ZeroPrecision supports '32-true' and 'bf16-mixed', not {precision!r}")
        self.precision = precision
        self.device = device

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device, dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError(
                f"ZeroPrecision clips a ZeroOptimizer's gradients, not a {type(optimizer).__name__}'s; use it with ZeroStrategy"
            )
        optimizer.clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        raise ValueError(CLIP_BY_VALUE)


class ZeroStrategy(pl.strategies.DDPStrategy):
    """Data parallelism through `optim.ZeroOptimizer` at ZeRO `stage` 0-3 (see the module
    docstring). Launch and process-group arguments are DDPStrategy's; `zero_kwargs` are
    ZeroOptimizer options (`optim.integrations.ZERO_OPTIONS`: precision, communication, ...);
    hyperparameters belong to configure_optimizers.
    `zero_optimizer` is the ZeroOptimizer once fit() has set it up."""

    def __init__(
        self,
        stage: int = 2,
        *,
        cluster_environment: Any = None,
        precision_plugin: pl.plugins.precision.Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        start_method: str = "popen",
        **zero_kwargs: Any,
    ) -> None:
        check_zero_options(
            stage,
            zero_kwargs,
            ZERO_OPTIONS,
            names=("ZeroStrategy", "stage", "ZeroStrategy keyword arguments"),
            instead="the optimizer configure_optimizers returns",
        )
        super().__init__(
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.stage = stage
        self.zero_kwargs = zero_kwargs
        self.zero_optimizer: ZeroOptimizer | None = None

    # ---- precision ------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> ZeroPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: pl.plugins.precision.Precision | None) -> None:
        self._precision_plugin = None if plugin is None else _zero_precision(plugin)

    # ---- setup ----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        """The module goes to the device, then (when fitting) the ZeroOptimizer is built over
        it; no DDP wrapper."""
        self.accelerator.setup(trainer)
        self.model_to_device()
        if trainer.state.fn == pl.trainer.states.TrainerFn.FITTING:
            _check_trainer(trainer, self)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """configure_optimizers' one optimizer as a ZeroOptimizer, its schedulers re-pointed."""
        module = self.lightning_module
        if module in _SHARDED:
            raise RuntimeError(
                "this LightningModule's parameters already belong to a ZeroOptimizer from an earlier fit; "
                "fit a freshly built module (resume with ckpt_path= to continue training)"
            )
        super().setup_optimizers(trainer)
        given = [o for o in self.optimizers if not isinstance(o, pl.core.optimizer._MockOptimizer)]
        if len(given) != 1:
            raise ValueError(
                f"configure_optimizers returned {len(given)} optimizers; ZeroStrategy trains with exactly one"
            )
        zero = self._taken(given[0]) if isinstance(given[0], ZeroOptimizer) else self._build(given[0])
        for config in self.lr_scheduler_configs:  # Lightning checked they drive this optimizer
            _point_scheduler_at(config.scheduler, zero)
        self.optimizers = [zero]
        self.zero_optimizer = zero
        _SHARDED.add(module)

    def _build(self, optimizer: torch.optim.Optimizer) -> ZeroOptimizer:
        """A ZeroOptimizer of the same class, param groups and hyperparameters as `optimizer`
        (which has not stepped), over the LightningModule. Frozen parameters in a group are
        dropped, as torch never steps them; a trainable one in no group is an error, since
        ZeroOptimizer would train it."""
        module = self.lightning_module
        listed = {p for g in optimizer.param_groups for p in g["params"]}
        for name, p in module.named_parameters():
            if p.requires_grad and p not in listed:
                raise ValueError(
                    f"parameter {name} requires grad but is in no param group of the optimizer configure_optimizers "
                    "returned; add it to a group or set requires_grad=False"
                )
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in optimizer.param_groups]
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return ZeroOptimizer(
            module, type(optimizer), stage=self.stage, param_groups=groups, **defaults, **self.zero_kwargs
        )

    def _taken(self, zero: ZeroOptimizer) -> ZeroOptimizer:
        """A ZeroOptimizer configure_optimizers built itself, if it is what the strategy would build."""
        if zero.model is not self.lightning_module:
            raise ValueError(
                "configure_optimizers returned a ZeroOptimizer over a submodule; build it over the LightningModule "
                "(ZeroOptimizer(self, ...)) or return a plain torch optimizer for ZeroStrategy to build"
            )
        if zero.stage != self.stage or self.zero_kwargs:
            raise ValueError(
                f"configure_optimizers returned its own ZeroOptimizer (stage {zero.stage}) under ZeroStrategy(stage={self.stage}"
                f"{''.join(f', {k}=...' for k in self.zero_kwargs)}); return a plain torch optimizer for ZeroStrategy to build, "
                "or give the strategy the same stage and no options"
            )
        return zero

    # ---- training -------------------------------------------------------------------------
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's hook around the non-final micro-batches of gradient accumulation: their
        gradients accumulate locally, and the last backward reduces them all."""
        with self.zero_optimizer.no_sync():
            yield

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_module("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_module("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._through_module("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._through_module("predict_step", *args, **kwargs)

    def _through_module(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`module.<method>(...)` called as `module(...)`, so that the hooks on the module run:
        at stage 3 they gather the parameters the LightningModule itself holds."""
        module = self.lightning_module
        return self._forward_redirection(module, module, method, *args, **kwargs)

    def teardown(self) -> None:
        """Lightning's teardown without moving the module to the CPU: that would detach its
        parameters from the optimizer's buffers (the optimizer is kept for the weights)."""
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- checkpoints ----------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer must exist to load into it

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores it

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state, trainable parameters as the optimizer's sharded fp32 masters
        (DCP ShardedTensors in the parameters' shapes), the rest as the module holds them;
        each tensor under its first name (a tied weight once)."""
        return checkpoint_folder.module_entries(self.lightning_module, self.zero_optimizer)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's sharded state dict on every rank (the folder's shards), where Lightning
        would consolidate an optimizer that has `consolidate_state_dict` onto rank 0."""
        return getattr(optimizer, "_optimizer", optimizer).state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A folder: "model" and "optimizer" as a sharded torch.distributed.checkpoint (every
        rank writes its shards; the masters once, under "model"), the rest of `checkpoint` in
        meta.pt from global rank 0."""
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy saves through torch.distributed.checkpoint and takes no storage_options; drop them"
            )
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero and path.is_file():
            path.unlink()
        self.barrier()
        path.mkdir(parents=True, exist_ok=True)
        state = {"model": checkpoint["state_dict"]}
        if checkpoint.get("optimizer_states"):
            state["optimizer"] = checkpoint_folder.optimizer_entries(
                checkpoint["optimizer_states"][0], with_masters=False
            )
        dcp.save(state, checkpoint_id=path)
        if self.is_global_zero:
            torch.save(
                {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}, path / META
            )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the module (and, when fitting, the optimizer) from a folder `save_checkpoint`
        wrote, at any world size and stage; returns the rest of the checkpoint for Lightning."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not checkpoint_folder.is_folder(path):
            raise FileNotFoundError(
                f"{path} is not a ZeroStrategy checkpoint (a folder with {META}); pass a folder ZeroStrategy saved"
            )
        module, zero = self.lightning_module, self.zero_optimizer
        state: dict[str, Any] = {"model": checkpoint_folder.module_entries(module, zero)}
        if zero is None:
            dcp.load(state, checkpoint_id=path)
        else:
            sd = zero.state_dict()
            fitting = module.trainer.state.fn == pl.trainer.states.TrainerFn.FITTING
            # Lightning's weights-only checkpoints hold no optimizer; it then refuses to resume from them itself
            if fitting and any(k.startswith("optimizer.") for k in checkpoint_folder.saved_keys(path)):
                state["optimizer"] = checkpoint_folder.optimizer_entries(sd, with_masters=False)
            dcp.load(state, checkpoint_id=path)
            checkpoint_folder.load_into(zero, sd, state.get("optimizer"))
        return torch.load(path / META, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: load_checkpoint has loaded the module."""

    # ---- full weights ---------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's unsharded `state_dict()`, trainable parameters from the fp32 masters in
        their original dtype. A collective: every rank calls it and gets the whole dict."""
        if self.zero_optimizer is None:
            return {k: v.detach().clone() for k, v in self.lightning_module.state_dict().items()}
        return self.zero_optimizer.full_state_dict()

    def save_full_weights(self, path: str | Path) -> None:
        """`torch.save(full_state_dict(), path)` from global rank 0, loadable with
        `module.load_state_dict(torch.load(path))` without Lightning or ZeroOptimizer. A
        collective, like full_state_dict."""
        weights = self.full_state_dict()
        if self.is_global_zero:
            torch.save(weights, path)
        self.barrier()


# ---- helpers ----------------------------------------------------------------------------------
def _zero_precision(plugin: pl.plugins.precision.Precision) -> ZeroPrecision:
    """The ZeroPrecision equivalent of the precision plugin Lightning chose for the Trainer."""
    if isinstance(plugin, ZeroPrecision):
        return plugin
    if type(plugin) is pl.plugins.precision.Precision:
        return ZeroPrecision()
    if type(plugin) is pl.plugins.precision.MixedPrecision and plugin.precision == "bf16-mixed":
        return ZeroPrecision("bf16-mixed", plugin.device)
    raise ValueError(
        f"ZeroStrategy supports precision '32-true' or 'bf16-mixed', not {getattr(plugin, 'precision', type(plugin).__name__)!r}; "
        "for bf16 weights with fp32 master copies use ZeroStrategy(precision=optim.policies.MixedPrecision(torch.bfloat16))"
    )


def _check_trainer(trainer: pl.Trainer, strategy: ZeroStrategy) -> None:
    """Trainer options ZeroStrategy cannot honour, refused before anything is built."""
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == pl.utilities.GradClipAlgorithmType.VALUE:
        raise ValueError(CLIP_BY_VALUE)
    if strategy._layer_sync is not None:
        raise ValueError("ZeroStrategy does not convert BatchNorm to SyncBatchNorm; drop sync_batchnorm=True")


def _point_scheduler_at(scheduler: Any, optimizer: ZeroOptimizer) -> None:
    """Re-point an LR scheduler built on the torch optimizer at its ZeroOptimizer. torch's
    LRScheduler marks the step() of its optimizer to warn about a scheduler stepped before
    it; the new optimizer's step() gets the same mark, so the check holds and stays quiet."""
    scheduler.optimizer = optimizer
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def marked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    marked_step._wrapped_by_lr_sched = True
    optimizer.step = marked_step
