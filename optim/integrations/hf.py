"""`ZeroTrainer`: Hugging Face `transformers.Trainer` training with a ZeroOptimizer (ZeRO
stages 0-3) in place of DDP + a torch optimizer.

Trainer's own path does not fit a ZeroOptimizer: accelerate wraps the model in DDP
(ZeroOptimizer reduces gradients itself, and a stage-3 module's parameters are empty
between uses), places the optimizer state on a device (it is sharded where the buckets
are), and saves `model.state_dict()` (empty at stage 3). Trainer's `model.zero_grad()`
clears ZeroOptimizer's gradients as it clears any (see optim.grad_placeholder).
ZeroTrainer changes exactly these points:

    Trainer                                  ZeroTrainer
    create_optimizer: a torch optimizer      ZeroOptimizer over the same decay / no-decay
                                             groups, built once the model is on its device
    accelerator.prepare(model, optimizer)    no DDP (autocast only); accelerate's optimizer
                                             wrapper without device placement
    accelerator.no_sync(model)               optimizer.no_sync() for the micro-batches that
                                             no optimizer step follows
    clip_grad_norm_(model.parameters())      optimizer.clip_grad_norm_: the global norm
    optimizer.pt from the main process       zero_optimizer/: torch.distributed.checkpoint,
                                             sharded, fp32 master weights included
    model.state_dict() -> model.safetensors  optimizer.full_state_dict() (a collective)

Data sharding, loss normalisation, LR schedule, logging, RNG and trainer state, and
evaluation are Trainer's own. As under DeepSpeed or FSDP, `trainer.save_model()` gathers
the weights and must run on every rank.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from optim.integrations import ZERO_OPTIONS, check_zero_options
from optim.policies import Communication
from optim.zero import ZeroOptimizer

# Trainer's internal steps that ZeroTrainer replaces (transformers 5.23); a version without one
# would silently take Trainer's own path (DDP, param.grad clipping), so importing refuses it.
TRAINER_HOOKS = (
    "_prepare_for_training",
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
    "_save",
)
ZERO_OPTIMIZER_DIR = "zero_optimizer"  # inside checkpoint-N/: the optimizer's DCP checkpoint
ELEMENTWISE_OPTIMS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop")
UNSUPPORTED_ARGS = {
    "fp16": "torch.amp's GradScaler cannot see ZeroOptimizer's gradients; use bf16=True",
    "fp16_full_eval": "casting the model for evaluation detaches it from the optimizer's buffers; leave it off",
    "bf16_full_eval": "casting the model for evaluation detaches it from the optimizer's buffers; leave it off",
    "load_best_model_at_end": "Trainer would load the best weights into the model, not into ZeroOptimizer, "
    "whose weights are the ones saved; load the best checkpoint's model.safetensors after training",
    "auto_find_batch_size": "a retried step would find the failed step's gradients in the optimizer's buckets; "
    "set the batch size yourself",
}


class ZeroTrainer(Trainer):
    """`transformers.Trainer` whose optimizer is a ZeroOptimizer (see the module docstring).

    Takes Trainer's arguments except `optimizers`: the optimizer is built by
    `create_optimizer` once the model is on its device, from TrainingArguments (`optim`,
    learning_rate, adam_beta1/2, adam_epsilon, weight_decay) or `optimizer_cls_and_kwargs`
    (any elementwise optimizer class), over Trainer's weight-decay / no-decay groups; plus

        zero_stage: ZeRO stage 0, 1, 2 or 3.
        zero_kwargs: ZeroOptimizer's options (`optim.integrations.ZERO_OPTIONS`: precision
            with param_dtype None or torch.bfloat16, communication, zero_plus_plus,
            step_backend).

    `ddp_find_unused_parameters=False` in TrainingArguments makes ZeroOptimizer's
    `Communication(find_unused_parameters=False)` promise (every parameter gets a gradient in every step),
    which saves two small all-reduces per step; otherwise parameters without a gradient in a
    step are found and left alone, as in torch.

    torch.distributed must be initialized (torchrun); the data-parallel group is the
    default group, over which Trainer shards the data. Unsupported settings raise one
    sentence at construction.
    """

    def __init__(
        self, *args: Any, zero_stage: int = 2, zero_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        check_zero_options(
            zero_stage,
            zero_kwargs or {},
            ZERO_OPTIONS,
            names=("ZeroTrainer", "zero_stage", "zero_kwargs"),
            instead="TrainingArguments",
        )
        self.zero_stage = zero_stage
        self.zero_kwargs = dict(zero_kwargs or {})
        super().__init__(*args, **kwargs)
        self._check_supported()

    def _check_supported(self) -> None:
        """One sentence for the first Trainer setting ZeroTrainer cannot honour."""
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise ValueError(
                "ZeroTrainer builds its ZeroOptimizer itself once the model is on its device; pass zero_stage= and "
                "zero_kwargs= (and optimizer_cls_and_kwargs= for another elementwise optimizer) instead of optimizers="
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or self.args.fsdp:
            raise ValueError(
                "ZeroTrainer cannot run under DeepSpeed or FSDP, which shard the model themselves; turn them off "
                "(TrainingArguments deepspeed / fsdp or the accelerate config) and choose the sharding with zero_stage"
            )
        for name, reason in UNSUPPORTED_ARGS.items():
            if getattr(self.args, name):
                raise ValueError(f"ZeroTrainer does not support {name}=True: {reason}")
        if self.args.n_gpu > 1:
            raise ValueError(
                f"ZeroTrainer needs one device per process, but this process sees {self.args.n_gpu} GPUs; "
                "launch one process per GPU with torchrun"
            )
        optim = getattr(self.args.optim, "value", self.args.optim)
        if self.optimizer_cls_and_kwargs is None and optim not in ELEMENTWISE_OPTIMS:
            raise ValueError(
                f"optim={optim!r} is not an elementwise optimizer that ZeroOptimizer can run on shards; use one of "
                f"{', '.join(ELEMENTWISE_OPTIMS)}, or pass an elementwise class with optimizer_cls_and_kwargs="
            )

    def _communication(self) -> Communication:
        """zero_kwargs' communication, with `ddp_find_unused_parameters=False` in
        TrainingArguments making DDP's promise (every parameter gets a gradient each step)."""
        communication = self.zero_kwargs.get("communication") or Communication()
        promised = self.args.ddp_find_unused_parameters is False
        return dataclasses.replace(
            communication, find_unused_parameters=communication.find_unused_parameters and not promised
        )

    @property
    def zero_optimizer(self) -> ZeroOptimizer | None:
        """The ZeroOptimizer (None until `create_optimizer`; `self.optimizer` is its wrapper)."""
        return self.optimizer.optimizer if self.optimizer is not None else None

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """A ZeroOptimizer over Trainer's weight-decay and no-decay groups, with Trainer's
        optimizer class and hyperparameters, in accelerate's optimizer wrapper. Runs after the
        model is on its device, since ZeroOptimizer moves the parameters into its buffers."""
        if self.optimizer is None:
            model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(model))
            trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in trainable if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
            ]
            cls, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model)
            zero = ZeroOptimizer(
                model,
                cls,
                stage=self.zero_stage,
                param_groups=[g for g in groups if g["params"]],
                **{**self.zero_kwargs, "communication": self._communication()},
                **kwargs,
            )
            self.optimizer = _AcceleratedZero(zero)
        return self.optimizer

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None) -> tuple:
        """Trainer's preparation without the DDP wrap (ZeroOptimizer reduces the gradients):
        create the optimizer and scheduler, let accelerate prepare the model for evaluation
        only (autocast under bf16), and load a checkpoint's optimizer and scheduler state."""
        if self._created_lr_scheduler:  # a later train() builds its schedule anew, as Trainer does
            self.lr_scheduler, self._created_lr_scheduler = None, False
        self.create_optimizer()
        model = self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Trainer's step; the backward of a micro-batch that no optimizer step follows only
        accumulates (Trainer's accelerator.no_sync reaches DDP only), unless accelerate's
        `sync_each_batch` asks to reduce every micro-batch (less gradient memory at stages 2-3)."""
        plugin = self.accelerator.gradient_state.plugin_kwargs
        if self.accelerator.sync_gradients or plugin.get("sync_each_batch", False):
            return super().training_step(model, inputs, num_items_in_batch)
        with self.zero_optimizer.no_sync():
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """Clip to max_grad_norm by the global norm over every shard; that norm, before clipping."""
        return self.zero_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """The global grad norm Trainer logs (computed without clipping when max_grad_norm <= 0)."""
        return self.zero_optimizer.clip_grad_norm_(float("inf")) if grad_norm is None else grad_norm

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer's sharded state (fp32 master weights included) with
        torch.distributed.checkpoint, every rank writing its shards; the scheduler as Trainer
        saves it, from the main process."""
        dcp.save(self.zero_optimizer.state_dict(), checkpoint_id=os.path.join(output_dir, ZERO_OPTIMIZER_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str) -> None:
        """Load what `_save_optimizer_and_scheduler` saved, at any data-parallel size or stage;
        the weights come back with the fp32 masters (a stage-3 model holds none of its own). A
        checkpoint without optimizer state (save_only_model) leaves both fresh, as in Trainer."""
        directory = os.path.join(checkpoint, ZERO_OPTIMIZER_DIR)
        if not os.path.isdir(directory):
            if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
                raise ValueError(
                    f"{checkpoint} holds a plain Trainer's {OPTIMIZER_NAME}, which ZeroTrainer cannot load; resume "
                    "from a ZeroTrainer checkpoint, or start a new run from the checkpoint's weights"
                )
            return
        state = self.zero_optimizer.state_dict()
        dcp.load(state, checkpoint_id=directory)
        self.zero_optimizer.load_state_dict(state)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _save(self, output_dir: str | None = None, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Trainer's save of the weights, gathered from ZeroOptimizer's fp32 masters: a
        collective, which is why Trainer's save_model runs on every rank; the main process writes."""
        if state_dict is None and self.optimizer is not None:
            state_dict = self.zero_optimizer.full_state_dict()
        super()._save(output_dir, state_dict=state_dict)


class _AcceleratedZero(AcceleratedOptimizer):
    """accelerate's optimizer wrapper, which Trainer expects, around a ZeroOptimizer, without
    device placement (the state is sharded where the buckets are)."""

    def __init__(self, optimizer: ZeroOptimizer) -> None:
        super().__init__(optimizer, device_placement=False)


def _require_trainer_hooks() -> None:
    """Refuse a transformers whose Trainer lacks one of the steps ZeroTrainer replaces."""
    missing = [hook for hook in TRAINER_HOOKS if not hasattr(Trainer, hook)]
    if missing:
        raise ImportError(
            f"transformers {transformers.__version__} has no Trainer.{missing[0]}, which ZeroTrainer replaces; "
            "install the transformers version of requirements.lock (5.23)"
        )


_require_trainer_hooks()
