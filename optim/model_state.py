"""The model's own `state_dict()` and `load_state_dict()` under ZeroOptimizer, which keeps the
fp32 masters apart from the model's parameters and, at stage 3, each gathered unit's
parameters as 1/N shards, leaving the parameters themselves empty between uses.

At every stage `model.state_dict()` gives each trained parameter a tensor of its own (a
tied weight one tensor under all its names): the parameters view the optimizer's flat
buffers, and savers that keep one tensor per storage (safetensors' save_model,
`save_pretrained`, accelerate's save_model) would otherwise drop weights or refuse.
`model.load_state_dict()` also updates the fp32 masters (where they are not the parameters'
own storage), so the next step goes on from the loaded weights. At stage 3:

    model.state_dict()       every parameter in full (compute dtype, as at stages 0-2): the
                             stage-3 buckets are all-gathered, so it is a collective; every
                             rank calls it, every rank gets the whole dict
    model.load_state_dict()  full tensors: each rank copies its own part into its fp32 master
                             and compute shards (no communication); the stage-3 placeholders a
                             per-rank state dict would hold (empty tensors) are refused

`model.state_dict()` checks in first (`optim.stage3.check_in`), so that a call on one rank
only (a checkpoint saved on rank 0 alone) raises on every rank or, if the other ranks never
reach a collective, is named by the collective watchdog, instead of gathering from the
wrong collectives.
Hooks sit on every module whose subtree holds a trained parameter, so a submodule's
`state_dict()` is the same; the buckets are gathered once per outermost call.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from optim.buffers import FlatBucket
from optim.stage3 import MODEL_STATE_DICT, ParamGatherer
from parallel import comm, flight

if TYPE_CHECKING:
    from optim.zero_state import ZeroState

PLACEHOLDER = (
    "model.load_state_dict() got an empty tensor for {name!r}, whose shape is {shape}: the state dict was saved "
    "from a ZeRO stage-3 model's freed parameters; save full weights (model.state_dict() on every rank, or "
    "opt.full_state_dict()) or use torch.distributed.checkpoint"
)
SHAPE = "model.load_state_dict() got {name!r} of shape {got}, but the parameter's shape is {shape}"


class ModelStateHooks:
    """The model's state-dict hooks (see module docstring)."""

    def __init__(self, shared: ZeroState, gatherer: ParamGatherer | None) -> None:
        """`gatherer`: stage 3's, which checks the call in on every rank (`ParamGatherer.check_in`)
        and forgets its hpZ copies once weights are loaded (`forget_secondary`)."""
        model, buckets = shared.model, shared.buckets
        self.gatherer = gatherer
        self.trained = {p for b in buckets for p in b.params}
        self.where = {p: (b, i) for b in buckets if b.sharding.parameters for i, p in enumerate(b.params)}
        self.resident = {
            p: (b, i)
            for b in buckets
            if not b.sharding.parameters and b.master.data_ptr() != b.opt_param.data_ptr()
            for i, p in enumerate(b.params)
        }
        self._keep_vars: list[bool] = []  # per state_dict() call in progress: its keep_vars
        self._full: dict[int, torch.Tensor] = {}  # id(bucket) -> its gathered flat params
        self._own: dict[torch.nn.Parameter, torch.Tensor] = {}  # parameter -> its tensor in this call
        self._handles = []
        for module in model.modules():
            if not any(p in self.trained for p in module.parameters()):
                continue
            self._handles += [
                module.register_state_dict_pre_hook(self._begin),
                module.register_state_dict_post_hook(partial(ModelStateHooks._fill, self)),
            ]
        for module in model.modules():
            if any(p in self.where or p in self.resident for p in module.parameters(recurse=False)):
                self._handles.append(module.register_load_state_dict_pre_hook(self._load))

    def _begin(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        """Pre-hook. `keep_vars=True` asks for the parameter objects themselves: left as they are."""
        if not self._keep_vars and not keep_vars and self.gatherer is not None:
            self.gatherer.check_in(MODEL_STATE_DICT)
        self._keep_vars.append(keep_vars)

    def _fill(self, module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        """Post-hook: the module's own trained parameters, each a tensor of its own (in full
        at stage 3); the outermost call then forgets the gathered buckets."""
        if not self._keep_vars.pop():
            for name, p in module.named_parameters(recurse=False):
                if p in self.trained and prefix + name in state_dict:
                    state_dict[prefix + name] = self._own_tensor(p, state_dict[prefix + name])
        if not self._keep_vars:
            self._full.clear()
            self._own.clear()

    def _own_tensor(self, p: torch.nn.Parameter, held: torch.Tensor) -> torch.Tensor:
        if p not in self._own:
            if p in self.where:
                b, i = self.where[p]
                held = b.param_view(self._gathered(b), i)
            self._own[p] = held.clone()
        return self._own[p]

    def _gathered(self, bucket: FlatBucket) -> torch.Tensor:
        if id(bucket) not in self._full:
            full = torch.empty(bucket.numel, dtype=bucket.param_dtype, device=bucket.param_shard.device)
            with flight.doing("model.state_dict() at stage 3 (a collective)"):
                comm.all_gather_into_tensor(full, bucket.param_shard, group=bucket.group)
            self._full[id(bucket)] = full
        return self._full[id(bucket)]

    def _load(self, module: torch.nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
        """Load pre-hook: copy this rank's part of each full tensor into the fp32 master (and,
        at stage 3, into the compute shard, handing torch an empty tensor for the parameter,
        which is empty between uses); torch then loads the gathered parameters as usual."""
        for name, p in module.named_parameters(recurse=False):
            key = prefix + name
            if key not in state_dict or not (p in self.where or p in self.resident):
                continue
            b, i = self.where.get(p) or self.resident[p]
            value = state_dict[key]
            if value.numel() == 0 and b.shapes[i].numel() > 0:
                raise RuntimeError(PLACEHOLDER.format(name=key, shape=tuple(b.shapes[i])))
            if value.shape != b.shapes[i]:
                raise RuntimeError(SHAPE.format(name=key, got=tuple(value.shape), shape=tuple(b.shapes[i])))
            flat = value.detach().reshape(-1)
            shards = [b.master, b.param_shard] if p in self.where else [b.master]
            for shard in {t.data_ptr(): t for t in shards}.values():
                start, part = b.param_slice(shard, i, b.shard_range if p in self.where else b.opt_range)
                part.copy_(flat[start : start + part.numel()])
            if p in self.where:
                state_dict[key] = torch.empty(0, dtype=p.dtype, device=p.device)
        if self.gatherer is not None:
            self.gatherer.forget_secondary()
